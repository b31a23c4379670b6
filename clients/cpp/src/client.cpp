#include "inferd/client.hpp"

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <algorithm>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <type_traits>

#include <sys/random.h>

#include "connection_watch.hpp"
#include "decode.hpp"
#include "internal.hpp"
#include "region_channel.hpp"
#include "send_buffer.hpp"

namespace inferd {

namespace detail {

void secure(zmq::socket_t& socket, const std::string& endpoint, const std::optional<ClientCurve>& curve) {
    // An IPv6 literal (tcp://[::1]:5555, or after a source address:
    // tcp://lo:0;[::1]:5555) needs ZMQ_IPV6 before the connect, as in
    // inferd_wire.endpoints.wants_ipv6; other endpoints stay as libzmq makes them.
    socket.set(zmq::sockopt::ipv6,
               endpoint.rfind("tcp://[", 0) == 0 || endpoint.find(";[") != std::string::npos);
    if (!curve) return;
    if (endpoint.rfind("tcp://", 0) != 0) {
        throw ClientError("CURVE is for tcp:// endpoints; " + endpoint +
                          " is reached through the file system's permissions and the daemon's "
                          "check of the connecting user");
    }
    socket.set(zmq::sockopt::curve_serverkey, curve->server_public_key);
    socket.set(zmq::sockopt::curve_publickey, curve->public_key);
    socket.set(zmq::sockopt::curve_secretkey, curve->secret_key);
}

std::optional<bool> poll_in(zmq::socket_t& socket, long long timeout_ms) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    try {
        return zmq::poll(&item, 1, std::chrono::milliseconds(std::max(0LL, timeout_ms))) > 0;
    } catch (const zmq::error_t& error) {
        if (error.num() != EINTR) throw;
        return std::nullopt;
    }
}

// The routing id each request socket sets: 16 bytes from the OS, the first
// never 0 (the shape libzmq reserves for the ids it generates, DESIGN.md 312).
constexpr std::size_t kRoutingIdBytes = 16;

std::string new_routing_id() {
    std::string id(kRoutingIdBytes, '\0');
    std::size_t filled = 0;
    while (filled < id.size()) {
        auto got = getrandom(id.data() + filled, id.size() - filled, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            throw ClientError(std::string("cannot draw a routing id from the OS (getrandom): ") +
                              std::strerror(errno));
        }
        filled += static_cast<std::size_t>(got);
    }
    // 1..255: a leading 0 is the shape libzmq reserves for the ids it generates.
    id[0] = static_cast<char>(1 + static_cast<unsigned char>(id[0]) % 255);
    return id;
}

}  // namespace detail

std::shared_ptr<zmq::context_t> shared_context() {
    static auto context = std::make_shared<zmq::context_t>(1);
    return context;
}

namespace {

// Frames below this are copied into ZeroMQ, larger ones sent from the caller's
// memory (pyzmq's copy threshold, which the Python client relies on too).
constexpr std::size_t kZeroCopyBytes = 64 * 1024;

// Counts zero-copy frames ZeroMQ still holds, so that no call returns while
// ZeroMQ may read the caller's memory.
struct InFlight {
    std::mutex mutex;
    std::condition_variable released;
    std::size_t frames = 0;
};

void release_frame(void* /*data*/, void* hint) {
    auto* in_flight = static_cast<InFlight*>(hint);
    std::lock_guard<std::mutex> lock(in_flight->mutex);
    --in_flight->frames;
    in_flight->released.notify_all();
}

// `max_reply_frame_bytes` checked (std::invalid_argument unless 1..2^63-34, so
// that CURVE's allowance still fits ZMQ_MAXMSGSIZE's int64), before any socket.
std::optional<std::int64_t> checked_frame_bound(std::optional<std::int64_t> bound) {
    constexpr auto kLargest = std::numeric_limits<std::int64_t>::max() - detail::kCurveFrameOverhead;
    if (bound && (*bound < 1 || *bound > kLargest)) {
        throw std::invalid_argument("max_reply_frame_bytes must be 1.." + std::to_string(kLargest) +
                                    " (or unset: no bound), got " + std::to_string(*bound));
    }
    return bound;
}

}  // namespace

// A DEALER that sends [header, *frames] and waits for the reply with the same id;
// replies to ids it no longer waits for are discarded and counted. Its reply
// frames are bounded by `max_reply_frame_bytes` (ZMQ_MAXMSGSIZE; nullopt: none),
// and a watch on its connection ends a wait whose connection ended (a frame over
// the bound ends it unread, and libzmq never connects again after that protocol
// error; a daemon that stopped): the call throws ConnectionLost at once, or
// resends while retries are left, and the socket is made anew. Not
// disconnect/connect: the DEALER drops the old connection's pipe only after the
// I/O thread's commands that end it, which come after the monitor's news, and a
// request sent in between went into the dead pipe (the Python client: 27 runs
// of 100 timed out, DESIGN.md 246). Each socket sets a routing id of its own
// (detail::new_routing_id), and a connection the daemon refuses at its handshake
// throws ConnectionRefused at once (the monitor's HANDSHAKE_FAILED_AUTH) when a
// call waits for it; the next call makes the socket anew, as does a call after a
// refusal met while none waited.
class RequestChannel {
public:
    RequestChannel(const ClientOptions& options, const std::string& default_endpoint,
                   int send_buffer_bytes, std::optional<std::int64_t> max_reply_frame_bytes)
        : context_(options.context ? options.context : shared_context()),
          endpoint_(check_client_endpoint(options.endpoint.empty() ? default_endpoint
                                                                   : options.endpoint)),
          timeout_(options.timeout),
          curve_(options.curve),
          on_attempt_(options.on_attempt),
          max_reply_frame_bytes_(checked_frame_bound(max_reply_frame_bytes)),
          send_buffer_(endpoint_, send_buffer_bytes) {
        // A random 24-bit prefix keeps ids from different clients apart in the
        // daemon's logs; the counter makes them unique within this client.
        std::random_device random;
        next_id_ = ((static_cast<std::uint64_t>(random()) & 0xFFFFFF) << 40) + 1;
        open();
    }

    ~RequestChannel() {
        close();
        wait_released();
    }

    struct Frame {
        const void* data;
        std::size_t size;
    };

    // Sends the header `encode(id)` gives and waits; resends under a fresh id up
    // to `retries` times, after a timeout or a lost connection. The first
    // message is the reply header.
    template <typename Encode>
    std::vector<zmq::message_t> request(Encode encode, const std::vector<Frame>& frames,
                                        std::optional<std::chrono::milliseconds> timeout,
                                        int retries) {
        auto wait = timeout.value_or(timeout_);
        // However the call ends (a reply, a timeout, a malformed reply), ZeroMQ
        // holds none of the caller's memory afterwards.
        struct ForgetUnsent {
            RequestChannel& channel;
            ~ForgetUnsent() { channel.forget_unsent(); }
        } forget{*this};
        for (int attempt = 0; attempt <= retries; ++attempt) {
            auto request_id = next_id();
            auto header = encode(request_id);
            if (header.size() > wire::kMaxHeaderFrameBytes) {
                // No daemon reads it: its refusal, with id null, would be no call's
                // answer, and the call would wait out its timeout (each attempt's).
                throw ClientError("the request header is " + std::to_string(header.size()) +
                                  " bytes; the limit is " +
                                  std::to_string(wire::kMaxHeaderFrameBytes) +
                                  ", whatever the daemon's bus.max_header_bytes (a header "
                                  "describes tensors, it never holds them)");
            }
            if (on_attempt_) on_attempt_(request_id, attempt);
            // The attempt's timeout bounds its send and its wait together.
            auto give_up_at = detail::deadline_after(wait);
            // A socket whose connection the daemon refused connects no more:
            // made anew, it connects again; so is one that could not be made
            // (open, forget_unsent).
            if (refused_ || !socket_) reopen();
            // News of a connection that ended while the channel was idle (a daemon
            // restart) is read now: later, it would fail a request sent on the
            // new connection. A refusal met while no call waited (at construction,
            // while idle) fails no call that never tried: the socket is made anew
            // for it too (review R2, F2). Only a refusal of the connection this
            // call waits for throws (send).
            lost(false);
            if (refused_) reopen();
            if (!send(header, frames, give_up_at)) continue;
            auto reply = await(request_id, give_up_at);
            if (!reply) {
                if (attempt < retries) continue;
                throw ConnectionLost(lost_message(request_id));
            }
            if (!reply->empty()) {
                // A reply came on a connection: its CONNECTED news is in by now,
                // and sizes it (the send buffer). A refusal (of a later
                // connection) is for the next call: this one has its reply.
                lost(false);
                return std::move(*reply);
            }
        }
        throw Timeout("no reply from " + endpoint_ + " within " + std::to_string(wait.count()) +
                      " ms after " + std::to_string(retries + 1) + " attempt(s)");
    }

    std::uint64_t discarded_replies() const { return discarded_; }
    const std::string& endpoint() const { return endpoint_; }
    // The next request id; every message on the shm socket draws from it too
    // (registrations included), so every id of this client is unique across
    // both sockets.
    std::uint64_t next_id() { return next_id_++; }
    const std::function<void(std::uint64_t, int)>& on_attempt() const { return on_attempt_; }
    const SendBufferStatus& send_buffer() const { return send_buffer_.status(); }
    std::uint64_t connections_lost() const { return connections_lost_; }

private:
    // ClientError (socket_error) when ZeroMQ cannot make the socket or its
    // monitor, the socket left closed: the next call makes it (request).
    void open() {
        try {
            socket_ = zmq::socket_t(*context_, zmq::socket_type::dealer);
        } catch (const zmq::error_t& error) {
            throw detail::socket_error(endpoint_, error);
        }
        socket_.set(zmq::sockopt::linger, 0);
        // Queue a request only on a connection that is up: without it, requests
        // sent while no daemon is there wait in the socket's queue past their
        // timeout and all run when one appears, and a full queue blocks every send.
        // (Making the socket again after each timeout would do the same at the
        // cost of a reconnect, and of the daemon seeing a new peer, each time.)
        socket_.set(zmq::sockopt::immediate, true);
        // Before the connect: a ROUTER generates an id (0x00 and a counter) for a
        // peer that sets none, unchecked against the ids other peers claimed
        // (DESIGN.md 312); and a new one per socket, since one made anew with the
        // old id while the daemon still held the old connection would be ignored
        // as a duplicate.
        socket_.set(zmq::sockopt::routing_id, zmq::buffer(detail::new_routing_id()));
        refused_ = false;
        detail::secure(socket_, endpoint_, curve_);
        if (max_reply_frame_bytes_) {
            // Over CURVE the bound covers the MESSAGE command around the frame
            // too: a frame of exactly the bound arrives either way.
            socket_.set(zmq::sockopt::maxmsgsize,
                        *max_reply_frame_bytes_ + (curve_ ? detail::kCurveFrameOverhead : 0));
        }
        // Before the connection it watches (and sizes: one monitor per socket).
        std::function<void(int)> connected;
        if (send_buffer_.wanted()) connected = [this](int fd) { send_buffer_.size(fd); };
        try {
            watch_ = std::make_unique<detail::ConnectionWatch>(*context_, socket_, std::move(connected));
        } catch (const zmq::error_t& error) {
            socket_.close();
            throw detail::socket_error(endpoint_, error);
        }
        try {
            socket_.connect(endpoint_);
        } catch (const zmq::error_t& error) {
            watch_.reset();
            throw std::invalid_argument("cannot connect to " + endpoint_ + ": " + error.what());
        }
    }

    void close() noexcept {
        watch_.reset();  // stops monitoring before the socket closes
        socket_.close();
    }

    // Reads the watch's news; when a connection that was up ended, makes the
    // socket anew (see the class's comment). Whether one did. With `refusal`,
    // throws ConnectionRefused when the daemon refused the connection at its
    // handshake (else the socket is marked refused, and the next call's start
    // makes it anew).
    bool lost(bool refusal = true) {
        if (!watch_) return false;
        auto news = watch_->check();
        if (news.lost != 0) {
            connections_lost_ += news.lost;
            reopen();  // a refusal the old socket met is the new one's to meet again
        } else if (news.refused) {
            refusal_status_ = *news.refused;
            refused_ = true;
            // libzmq never connects a refused socket again: no tries of its own
            // while the caller makes room; the next call reopens.
            detail::disconnect_from(socket_, endpoint_);
        }
        if (refusal && refused_) {
            throw detail::refused_error(endpoint_, refusal_status_, "the next call connects anew");
        }
        return news.lost != 0;
    }

    void reopen() {
        close();
        wait_released();  // what the closed socket held of the caller's frames
        open();
    }

    std::string lost_message(std::uint64_t request_id) const {
        std::string why =
            "the daemon closed it (it stopped or restarted, or a request frame was over twice "
            "its bus.max_message_bytes)";
        if (max_reply_frame_bytes_) {
            why = "a reply frame over " + std::to_string(*max_reply_frame_bytes_) +
                  " bytes (the client's bound) ended it unread, or " + why;
        }
        return "the connection to " + endpoint_ + " ended while request " +
               std::to_string(request_id) + " waited for its reply: " + why +
               "; it is connected again for the next call";
    }

    // False when the request could not leave before `give_up_at` (no connection
    // up, or the daemon not reading). Throws ConnectionRefused when the daemon
    // refuses the connection it waits for.
    bool send(const std::string& header, const std::vector<Frame>& frames,
              std::chrono::steady_clock::time_point give_up_at) {
        zmq::message_t head(header.data(), header.size());
        auto more = frames.empty() ? zmq::send_flags::dontwait
                                   : zmq::send_flags::sndmore | zmq::send_flags::dontwait;
        // ZeroMQ queues a multipart message atomically: only the first part can be
        // refused. It waits for room (a connection up: ZMQ_IMMEDIATE) on the socket
        // and the monitor together, not in a blocking send: the monitor's news of
        // a refused handshake ends the wait at once.
        while (true) {
            auto sent = interrupted_or([&] { return socket_.send(head, more); });
            if (!sent) continue;  // a signal handler ran: look again
            if (*sent) break;
            // Nothing was sent: a lost connection makes the socket anew (the
            // request goes on the new one), a refused one throws.
            lost();
            auto left = detail::milliseconds_left(give_up_at);
            if (left <= 0) return false;
            detail::wait_either(socket_, watch_->monitor(), left, ZMQ_POLLOUT);
        }
        for (std::size_t i = 0; i < frames.size(); ++i) {
            auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
            const auto& frame = frames[i];
            if (frame.size < kZeroCopyBytes) {
                zmq::message_t part(frame.data, frame.size);
                while (!interrupted_or([&] { return socket_.send(part, flags); })) {}
                continue;
            }
            {
                std::lock_guard<std::mutex> lock(in_flight_.mutex);
                ++in_flight_.frames;
            }
            zmq::message_t part(const_cast<void*>(frame.data), frame.size, release_frame,
                                &in_flight_);
            while (!interrupted_or([&] { return socket_.send(part, flags); })) {}
        }
        return true;
    }

    // `call()`, or nullopt when a signal handler interrupted it (EINTR: a
    // zmq_send waiting for a connection returns it; cppzmq throws it). The caller
    // tries again, as pyzmq does.
    template <typename Call>
    static std::optional<std::invoke_result_t<Call>> interrupted_or(Call call) {
        try {
            return call();
        } catch (const zmq::error_t& error) {
            if (error.num() != EINTR) throw;
            return std::nullopt;
        }
    }

    // The reply (its parts), an empty vector once `give_up_at` has passed, or
    // nullopt when the connection ended while the request waited (the socket is
    // then made anew). A reply already there is taken first.
    std::optional<std::vector<zmq::message_t>> await(
        std::uint64_t request_id, std::chrono::steady_clock::time_point give_up_at) {
        bool news = false;
        std::vector<zmq::message_t> parts;
        while (true) {
            if (!detail::recv_message(socket_, parts)) {
                // The news was read just before the send; later news ends a wait.
                if (news && lost()) return std::nullopt;
                // Rounded up, and measured again after a poll that found nothing:
                // zmq_poll times its wait on a clock that may lag by a millisecond,
                // and a wait never ends before the caller's timeout.
                auto left = detail::milliseconds_left(give_up_at);
                if (left <= 0) return std::vector<zmq::message_t>{};
                news = detail::wait_either(socket_, watch_->monitor(), left);
                continue;
            }
            auto id = wire::decode_reply_id(parts[0].data(), parts[0].size());
            if (id != wire::RequestId{request_id}) {
                ++discarded_;
                continue;
            }
            return parts;
        }
    }

    // Zero-copy frames ZeroMQ still holds after the call (an attempt that was
    // never answered may still be queued): drop them with a fresh socket, so the
    // caller's memory is the caller's again when the call returns.
    void forget_unsent() noexcept {
        {
            std::lock_guard<std::mutex> lock(in_flight_.mutex);
            if (in_flight_.frames == 0) return;
        }
        close();
        wait_released();
        try {
            open();
        } catch (const std::exception&) {
            // Out of file descriptors or a terminated context: the socket stays
            // closed, and the next call makes it (or says why it cannot).
        }
    }

    void wait_released() {
        std::unique_lock<std::mutex> lock(in_flight_.mutex);
        in_flight_.released.wait(lock, [this] { return in_flight_.frames == 0; });
    }

    std::shared_ptr<zmq::context_t> context_;
    std::string endpoint_;
    std::chrono::milliseconds timeout_;
    std::optional<ClientCurve> curve_;
    std::function<void(std::uint64_t, int)> on_attempt_;
    zmq::socket_t socket_;
    // The daemon refused this socket's connection at its handshake (its ZAP
    // status): made anew before the next send.
    bool refused_ = false;
    int refusal_status_ = 0;
    std::uint64_t next_id_ = 1;
    std::uint64_t discarded_ = 0;
    std::uint64_t connections_lost_ = 0;
    std::optional<std::int64_t> max_reply_frame_bytes_;
    InFlight in_flight_;
    detail::SendBuffer send_buffer_;
    // The socket's monitor (stopped before the socket closes); null while closed.
    std::unique_ptr<detail::ConnectionWatch> watch_;
};

InferResult::InferResult() = default;
InferResult::~InferResult() = default;
InferResult::InferResult(InferResult&&) noexcept = default;
InferResult& InferResult::operator=(InferResult&&) noexcept = default;

const TensorView& InferResult::output(const std::string& name) const {
    for (const auto& output : outputs) {
        if (output.name == name) return output.tensor;
    }
    throw ClientError("the reply has no output '" + name + "'");
}

InferenceClient::InferenceClient(ClientOptions options)
    : channel_(std::make_unique<RequestChannel>(options, default_endpoints().infer,
                                                options.send_buffer_bytes,
                                                options.max_reply_frame_bytes)),
      options_(std::move(options)) {
    PollWindow check(options_.reply_spin_us);  // a bad width fails here, not at the first region
    if (options_.shm_socket.empty()) options_.shm_socket = shm_socket_path(channel_->endpoint());
}

InferenceClient::~InferenceClient() {
    shm_.reset();  // the daemon releases the regions registered here
    owned_.clear();
}

std::uint64_t InferenceClient::discarded_replies() const {
    return channel_->discarded_replies() + closed_shm_discarded_ +
           (shm_ ? shm_->discarded_replies() : 0);
}

SendBufferStatus InferenceClient::send_buffer() const { return channel_->send_buffer(); }

std::uint64_t InferenceClient::connections_lost() const { return channel_->connections_lost(); }

PollWindowStatus InferenceClient::reply_spin() const {
    return shm_ ? shm_->spin().status() : PollWindow(options_.reply_spin_us).status();
}

const std::string& InferenceClient::endpoint() const { return channel_->endpoint(); }

namespace {

// The delay before a region that failed to register again is tried again,
// doubling with each failure in a row up to kRetryMax (the Python client's
// inferd_client.pending_regions): a daemon that refuses it (shm disabled, a byte
// bound below its size, bounds other clients fill) keeps refusing until someone
// changes something, and a camera loop would otherwise hand it the memfd at
// every frame, each try a round trip (or a timeout) added to the call.
constexpr std::chrono::milliseconds kRetryFirst{1000};
constexpr std::chrono::milliseconds kRetryMax{60000};

}  // namespace

ShmRegions InferenceClient::shm_regions() const {
    ShmRegions status;
    status.registered = static_cast<std::size_t>(std::count_if(
        regions_.begin(), regions_.end(), [](const auto& entry) { return entry.second->base != nullptr; }));
    status.failed_registrations = failed_registrations_;
    auto now = std::chrono::steady_clock::now();
    for (const auto& entry : released_) {
        if (entry.mapping->base == nullptr) continue;
        PendingRegion pending;
        pending.label = entry.mapping->label;
        pending.nbytes = entry.mapping->size;
        pending.failures = entry.failures;
        pending.error = entry.error;
        if (entry.retry_at > now) {
            pending.retry_in = std::chrono::ceil<std::chrono::milliseconds>(entry.retry_at - now);
        }
        status.pending.push_back(std::move(pending));
    }
    return status;
}

SharedRegion& InferenceClient::shared_region(std::size_t nbytes, std::optional<std::string> label) {
    auto region = std::make_unique<SharedRegion>(nbytes, std::move(label));
    register_region(*region);
    owned_.push_back(std::move(region));
    return *owned_.back();
}

void InferenceClient::release_ended_regions() {
    for (auto it = regions_.begin(); it != regions_.end();) {
        if (it->second->base != nullptr) {
            ++it;
            continue;
        }
        if (shm_) shm_->release(it->first);
        it = regions_.erase(it);
    }
    released_.erase(std::remove_if(released_.begin(), released_.end(),
                                   [](const Released& entry) { return entry.mapping->base == nullptr; }),
                    released_.end());
}

void InferenceClient::shm_closed() {
    for (const auto& [id, mapping] : regions_) {
        if (mapping->base == nullptr) continue;
        Released entry;
        entry.mapping = mapping;
        released_.push_back(std::move(entry));
    }
    regions_.clear();
    closed_shm_discarded_ += shm_->discarded_replies();
    shm_.reset();
}

std::string InferenceClient::register_mapping(
    const std::shared_ptr<const detail::RegionMapping>& mapping,
    std::optional<std::chrono::steady_clock::time_point> give_up_at) {
    // What is left of the call's time, for the connect and then the registration
    // (unset: the client's timeout, each).
    auto left = [&give_up_at]() -> std::optional<std::chrono::milliseconds> {
        if (!give_up_at) return std::nullopt;
        return std::chrono::milliseconds(std::max(detail::milliseconds_left(*give_up_at), 0LL));
    };
    if (!shm_) {
        shm_ = std::make_unique<RegionChannel>(options_.shm_socket, options_.timeout,
                                               options_.reply_spin_us,
                                               [this] { return channel_->next_id(); }, left());
    }
    std::string id;
    try {
        id = shm_->register_region(mapping, left());
    } catch (const ClientError&) {
        if (shm_->hung_up()) shm_closed();  // its next registration is on a new connection
        throw;
    }
    regions_.emplace_back(id, mapping);
    return id;
}

std::string InferenceClient::register_released(
    const std::shared_ptr<const detail::RegionMapping>& mapping,
    std::optional<std::chrono::steady_clock::time_point> give_up_at) {
    // Found again after the registration: a connection that failed moved the
    // registered regions to released_ meanwhile (shm_closed).
    auto pending = [this, &mapping] {
        return std::find_if(released_.begin(), released_.end(),
                            [&mapping](const Released& entry) { return entry.mapping == mapping; });
    };
    std::string id;
    try {
        id = register_mapping(mapping, give_up_at);
    } catch (const ClientError& error) {
        auto entry = pending();
        if (entry != released_.end()) {
            ++failed_registrations_;
            ++entry->failures;
            entry->error = error.what();
            auto doublings = std::min<std::uint64_t>(entry->failures - 1, 6);
            entry->retry_at = std::chrono::steady_clock::now() +
                              std::min(kRetryFirst * (std::int64_t{1} << doublings), kRetryMax);
        }
        throw;
    }
    auto entry = pending();
    if (entry != released_.end()) released_.erase(entry);
    return id;
}

void InferenceClient::register_named(const std::vector<NamedTensor>& inputs,
                                     const InferOptions& options,
                                     std::chrono::milliseconds timeout) {
    auto named = [&inputs, &options](const detail::RegionMapping& mapping) {
        for (const auto& input : inputs) {
            if (mapping.locate(input.tensor.data, input.tensor.nbytes)) return true;
        }
        for (const auto& output : options.outputs) {
            if (mapping.locate(output.buffer.data, output.buffer.nbytes)) return true;
        }
        return false;
    };
    auto due_now = [this, &named] {
        auto now = std::chrono::steady_clock::now();
        std::vector<std::shared_ptr<const detail::RegionMapping>> due;
        for (const auto& entry : released_) {
            if (entry.retry_at <= now && entry.mapping->base != nullptr && named(*entry.mapping)) {
                due.push_back(entry.mapping);
            }
        }
        return due;
    };
    auto due = due_now();
    if (due.empty()) return;
    if (shm_ && shm_->hung_up()) {
        // The daemon closed it (a restart) while another region was registered
        // there: a try sent on it would fail, be counted and be put off for
        // nothing. Its regions are pending now too.
        shm_closed();
        due = due_now();
    }
    // One deadline for all the call's tries, connects included.
    auto give_up_at = detail::deadline_after(timeout);
    for (std::size_t tried = 0; tried < due.size(); ++tried) {
        // Those the call has no time left for stay due, for the next call naming them.
        if (tried > 0 && detail::milliseconds_left(give_up_at) <= 0) return;
        try {
            register_released(due[tried], give_up_at);
            continue;
        } catch (const RemoteError&) {
            // Pending still, its tensors go as frames (shm_regions() says why). A
            // refusal of this region (a byte bound) on a connection still open
            // says nothing of the others: the next is tried.
            if (shm_) continue;
        } catch (const ClientError&) {
        }
        // No connection, a connection refused, or no answer: the others would
        // find the same, each waiting as long again. They wait as long as this one.
        put_off(due, tried);
        return;
    }
}

void InferenceClient::put_off(const std::vector<std::shared_ptr<const detail::RegionMapping>>& due,
                              std::size_t failed) {
    auto find = [this](const std::shared_ptr<const detail::RegionMapping>& mapping) {
        return std::find_if(released_.begin(), released_.end(),
                            [&mapping](const Released& entry) { return entry.mapping == mapping; });
    };
    auto leader = find(due[failed]);
    if (leader == released_.end()) return;
    auto retry_at = leader->retry_at;
    for (auto i = failed + 1; i < due.size(); ++i) {
        auto entry = find(due[i]);
        if (entry != released_.end()) entry->retry_at = std::max(entry->retry_at, retry_at);
    }
}

std::string InferenceClient::register_region(SharedRegion& region) {
    release_ended_regions();
    if (!region.mapping_) throw ClientError("the shared region is closed");
    // Closed by the daemon (a restart): this region goes on a new connection, and
    // the others stay pending for the calls naming them.
    if (shm_ && shm_->hung_up()) shm_closed();
    for (const auto& [id, known] : regions_) {
        if (known == region.mapping_) return id;
    }
    for (const auto& entry : released_) {
        if (entry.mapping == region.mapping_) return register_released(region.mapping_);
    }
    return register_mapping(region.mapping_);
}

void InferenceClient::unregister_region(SharedRegion& region) {
    release_ended_regions();
    released_.erase(std::remove_if(released_.begin(), released_.end(),
                                   [&region](const Released& entry) { return entry.mapping == region.mapping_; }),
                    released_.end());
    for (auto it = regions_.begin(); it != regions_.end(); ++it) {
        if (it->second == region.mapping_ && region.mapping_) {
            auto id = it->first;
            regions_.erase(it);
            if (!shm_) return;
            try {
                shm_->unregister_region(id);
            } catch (const ClientError&) {
                if (!shm_->hung_up()) throw;
                shm_closed();  // the connection's end released it with the rest
            }
            return;
        }
    }
}

namespace {

using Regions = std::vector<std::pair<std::string, std::shared_ptr<const detail::RegionMapping>>>;

std::optional<wire::RegionRef> locate(const Regions& regions, const void* data, std::size_t nbytes) {
    for (const auto& [id, mapping] : regions) {
        if (auto offset = mapping->locate(data, nbytes)) return wire::RegionRef{id, *offset, nbytes};
    }
    return std::nullopt;
}

[[noreturn]] void raise_error(const wire::ErrorInfo& error) {
    throw RemoteError(error.code, error.message);
}

// An ok infer reply names the model the request did: another's answer is no
// answer to it (the Python client's check_infer_reply too).
void check_model(const wire::InferReply& reply, const std::string& model) {
    if (reply.model != model) {
        throw MalformedReply("infer reply names the model '" + reply.model.substr(0, 80) +
                             "'; the request named '" + model.substr(0, 80) + "'");
    }
}

template <typename Named>
std::set<std::string> names_of(const std::vector<Named>& items) {
    std::set<std::string> names;
    for (const auto& item : items) names.insert(item.name);
    return names;
}

// The request's descriptors (a tensor in a registered region by reference) and
// the frames of the others.
void prepare_request(const Regions& regions, const std::string& model,
                     const std::vector<NamedTensor>& inputs, const InferOptions& options,
                     wire::InferRequest& request, std::vector<RequestChannel::Frame>& frames) {
    request = wire::InferRequest{};
    frames.clear();
    request.model = model;
    request.deadline_ms = options.deadline_ms;
    for (const auto& input : inputs) {
        const auto& tensor = input.tensor;
        if (tensor_bytes(tensor.dtype, tensor.shape) != tensor.nbytes) {
            throw ClientError("input '" + input.name + "': its shape and dtype need " +
                              std::to_string(tensor_bytes(tensor.dtype, tensor.shape)) +
                              " bytes, the view has " + std::to_string(tensor.nbytes));
        }
        wire::TensorDescriptor descriptor{input.name, tensor.dtype, tensor.shape, std::nullopt};
        descriptor.region = locate(regions, tensor.data, tensor.nbytes);
        if (!descriptor.region) frames.push_back({tensor.data, tensor.nbytes});
        request.inputs.push_back(std::move(descriptor));
    }
    for (const auto& output : options.outputs) {
        const auto& buffer = output.buffer;
        if (tensor_bytes(buffer.dtype, buffer.shape) != buffer.nbytes) {
            throw ClientError("output '" + output.name + "': its shape and dtype need " +
                              std::to_string(tensor_bytes(buffer.dtype, buffer.shape)) +
                              " bytes, the buffer has " + std::to_string(buffer.nbytes));
        }
        if (auto ref = locate(regions, buffer.data, buffer.nbytes)) {
            request.outputs.push_back({output.name, buffer.dtype, buffer.shape, ref});
        }
    }
}

// Whether the request fits one message of shm.sock under any id (it sets the id
// to the one msgpack packs longest): the daemon reads no more of a longer
// message, its id included, and refuses it with id null.
bool fits_shm_message(wire::InferRequest& request) {
    request.id = std::numeric_limits<std::uint64_t>::max();
    return wire::encode_infer_request(request).size() <= wire::kMaxShmMessageBytes;
}

bool names_a_region(const wire::InferRequest& request) {
    auto in_region = [](const wire::TensorDescriptor& tensor) { return tensor.region.has_value(); };
    return !request.outputs.empty() ||
           std::any_of(request.inputs.begin(), request.inputs.end(), in_region);
}

}  // namespace

InferResult InferenceClient::infer(const std::string& model, const std::vector<NamedTensor>& inputs,
                                   const InferOptions& options) {
    release_ended_regions();
    auto timeout = options.timeout.value_or(options_.timeout);
    if (!released_.empty()) register_named(inputs, options, timeout);
    wire::InferRequest request;
    std::vector<RequestChannel::Frame> frames;
    prepare_request(regions_, model, inputs, options, request, frames);
    bool on_shm = shm_ && frames.empty() && places_every_output(model, request.outputs);
    if (!on_shm && shm_ && names_a_region(request) && shm_->hung_up()) {
        // Closed while nothing used it (a restart): the ids it named died with it.
        shm_closed();
        register_named(inputs, options, timeout);
        prepare_request(regions_, model, inputs, options, request, frames);
        on_shm = shm_ && frames.empty() && places_every_output(model, request.outputs);
    }
    // One too long for shm.sock goes on the infer socket, regions and placed outputs as they are.
    on_shm = on_shm && fits_shm_message(request);
    request.max_reply_frame_bytes = options_.max_reply_frame_bytes;
    auto encode = [&request](std::uint64_t id) {
        request.id = id;
        return wire::encode_infer_request(request);
    };
    auto retries = options.retries.value_or(options_.retries);
    if (on_shm) {
        std::string header;
        last_transport_ = "shm";  // as it is sent: a call that throws names it too
        try {
            header = shm_->request(model, encode, channel_->on_attempt(), timeout, retries);
        } catch (const ClientError&) {
            if (shm_->hung_up()) shm_closed();  // a call naming its regions registers them again
            throw;
        }
        InferResult result;
        result.reply = wire::decode_infer_reply(header.data(), header.size());
        if (!result.reply.ok) {
            output_names_.erase(model);  // learn them again (a reloaded model)
            raise_error(*result.reply.error);
        }
        check_model(result.reply, model);
        result.outputs = wire::decode_outputs(result.reply, {}, request.outputs, options.outputs);
        return result;
    }
    last_transport_ = "infer";
    auto parts = channel_->request(encode, frames, options.timeout, retries);

    InferResult result;
    result.reply = wire::decode_infer_reply(parts[0].data(), parts[0].size());
    if (!result.reply.ok) raise_error(*result.reply.error);
    check_model(result.reply, model);
    output_names_[model] = names_of(result.reply.outputs);
    std::vector<wire::FrameBytes> frames_received;
    for (std::size_t i = 1; i < parts.size(); ++i) {
        frames_received.push_back({parts[i].data(), parts[i].size()});
    }
    result.outputs = wire::decode_outputs(result.reply, frames_received, request.outputs,
                                          options.outputs);
    for (auto& output : result.outputs) {
        auto& tensor = output.tensor;
        if (reinterpret_cast<std::uintptr_t>(tensor.data) % itemsize(tensor.dtype) == 0) continue;
        // ZeroMQ hands a small or mid-sized frame at any offset of its receive
        // buffer: reading a float there is undefined, so such a frame is copied
        // (new[] aligns for every dtype).
        auto aligned = std::make_unique<unsigned char[]>(tensor.nbytes);
        std::memcpy(aligned.get(), tensor.data, tensor.nbytes);
        tensor.data = aligned.get();
        result.aligned_.push_back(std::move(aligned));
    }
    // The views point into these frames, and a small frame's bytes live inside its
    // message_t: the vector moves whole (its elements stay where they are), never
    // element by element.
    result.frames_ = std::move(parts);
    return result;
}


namespace {

TensorSpec read_spec(const msgpack::object& value, const std::string& where) {
    detail::Fields fields(value, where);
    fields.only({"name", "dtype", "shape", "profile"});
    TensorSpec spec;
    spec.name = fields.string("name");
    spec.dtype = parse_dtype(fields.string("dtype"));
    const auto& shape = fields.required("shape");
    // As a reply's descriptor (tensor_spec): a dimension past 2^63 read as an
    // int64 would be negative.
    if (shape.type != msgpack::type::ARRAY || shape.via.array.size > wire::kMaxDimensions) {
        detail::malformed(where + ".shape must be a list of at most 16 dimensions");
    }
    for (std::uint32_t i = 0; i < shape.via.array.size; ++i) {
        const auto& dimension = shape.via.array.ptr[i];
        if (dimension.type == msgpack::type::NIL) {
            spec.shape.emplace_back(std::nullopt);
        } else if (detail::is_uint(dimension) && dimension.via.u64 < (1ULL << 31)) {
            spec.shape.emplace_back(static_cast<std::int64_t>(dimension.via.u64));
        } else {
            detail::malformed(where + ".shape holds a dimension that is neither 0..2^31-1 nor null");
        }
    }
    if (fields.find("profile") != nullptr) spec.profile_json = fields.json("profile");
    return spec;
}

std::vector<TensorSpec> read_specs(const detail::Fields& fields, std::string_view key) {
    const auto& list = fields.required(key);
    if (list.type != msgpack::type::ARRAY) detail::malformed(fields.where() + " specs must be a list");
    std::vector<TensorSpec> specs;
    for (std::uint32_t i = 0; i < list.via.array.size; ++i) {
        specs.push_back(read_spec(list.via.array.ptr[i], fields.where() + "." + std::string(key)));
    }
    return specs;
}

}  // namespace

std::vector<ModelDescription> InferenceClient::describe(
    std::optional<std::chrono::milliseconds> timeout) {
    auto parts = channel_->request(
        [](std::uint64_t id) { return wire::encode_describe_request(id); }, {}, timeout, 0);
    auto reply = wire::decode_control_reply(parts[0].data(), parts[0].size());
    if (!reply.ok) raise_error(*reply.error);
    auto models =
        wire::decode_describe_result(reply.result_msgpack.data(), reply.result_msgpack.size());
    for (const auto& model : models) {
        if (!model.outputs.empty()) output_names_[model.name] = names_of(model.outputs);
    }
    return models;
}

bool InferenceClient::places_every_output(
    const std::string& model, const std::vector<wire::TensorDescriptor>& placed) const {
    auto known = output_names_.find(model);
    if (placed.empty() || known == output_names_.end()) return false;
    auto names = names_of(placed);
    return std::includes(names.begin(), names.end(), known->second.begin(), known->second.end());
}

namespace {

// OperatorClient's bound: a control reply is one header (the daemon's control
// replies carry no frames), whatever ClientOptions asks.
std::int64_t control_frame_bound(const ClientOptions& options) {
    if (options.max_reply_frame_bytes) {
        throw std::invalid_argument(
            "max_reply_frame_bytes is for InferenceClient; OperatorClient's replies are bounded "
            "to a header (" + std::to_string(wire::kMaxHeaderBytes) + " bytes)");
    }
    return static_cast<std::int64_t>(wire::kMaxHeaderBytes);
}

}  // namespace

OperatorClient::OperatorClient(ClientOptions options)
    // Small messages: the kernel's default send buffer takes each whole.
    : channel_(std::make_unique<RequestChannel>(options, default_endpoints().control, 0,
                                                control_frame_bound(options))) {}

OperatorClient::~OperatorClient() = default;

std::uint64_t OperatorClient::connections_lost() const { return channel_->connections_lost(); }

std::string OperatorClient::call_msgpack(const std::string& op,
                                         const wire::ControlArguments& arguments,
                                         std::optional<std::chrono::milliseconds> timeout) {
    auto parts = channel_->request(
        [&](std::uint64_t id) { return wire::encode_control_request(id, op, arguments); }, {},
        timeout, 0);
    auto reply = wire::decode_control_reply(parts[0].data(), parts[0].size());
    if (!reply.ok) raise_error(*reply.error);
    return reply.result_msgpack;
}

std::string OperatorClient::call(const std::string& op, const wire::ControlArguments& arguments,
                                 std::optional<std::chrono::milliseconds> timeout) {
    auto result = call_msgpack(op, arguments, timeout);
    return wire::msgpack_to_json(result.data(), result.size());
}

HealthSnapshot OperatorClient::health() {
    auto result = call_msgpack("health", {}, std::nullopt);
    return wire::decode_health_result(result.data(), result.size());
}

Status OperatorClient::status() {
    auto result = call_msgpack("status", {}, std::nullopt);
    auto handle = detail::unpack(result.data(), result.size(), result.size());
    detail::Fields fields(handle.get(), "status result");
    Status status;
    status.state = fields.map("daemon").string("state");
    const auto& models = fields.required("models");
    if (models.type != msgpack::type::ARRAY) detail::malformed("status models must be a list");
    for (std::uint32_t i = 0; i < models.via.array.size; ++i) {
        detail::Fields model(models.via.array.ptr[i], "status model");
        ModelStatus item;
        item.model = model.string("model");
        item.state = model.string("state");
        item.runtime = model.nullable_string("runtime");
        item.fallback = model.boolean("fallback");
        item.requests = model.uint("requests");
        item.queue_depth = model.uint("queue_depth");
        item.late_results = model.uint("late_results");
        auto responses = model.map("responses");
        for (std::uint32_t j = 0; j < responses.object().via.map.size; ++j) {
            const auto& entry = responses.object().via.map.ptr[j];
            auto code = detail::as_string(entry.key, "status responses");
            if (!detail::is_uint(entry.val)) detail::malformed("status responses must count");
            item.responses[code] = entry.val.via.u64;
        }
        status.models.push_back(std::move(item));
    }
    status.json = detail::to_json(handle.get());
    return status;
}

SwitchResult OperatorClient::switch_runtime(const std::string& model, const std::string& runtime,
                                            const std::optional<std::string>& requested_by) {
    wire::ControlArguments arguments{{"model", model}, {"runtime", runtime}};
    if (requested_by) arguments.emplace_back("requested_by", *requested_by);
    // The reply comes once the new runtime serves: a slow preparation needs the
    // client's timeout set accordingly (as in the Python client).
    auto result = call_msgpack("runtime.switch", arguments, std::nullopt);
    return wire::decode_switch_result(result.data(), result.size());
}

}  // namespace inferd

namespace inferd::wire {

HealthSnapshot decode_health_result(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, size);
    return detail::read_health(detail::Fields(handle.get(), "health result"), {});
}

SwitchResult decode_switch_result(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, size);
    detail::Fields fields(handle.get(), "switch result");
    fields.only({"model", "from_runtime", "to_runtime", "active_providers", "prepare_ms", "swap_ms"});
    SwitchResult switched;
    switched.model = fields.string("model");
    switched.from_runtime = fields.nullable_string("from_runtime");
    switched.to_runtime = fields.string("to_runtime");
    switched.active_providers = fields.strings("active_providers");
    switched.prepare_ms = fields.number("prepare_ms");
    switched.swap_ms = fields.number("swap_ms");
    return switched;
}

std::vector<ModelDescription> decode_describe_result(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, size);
    detail::Fields result(handle.get(), "describe result");
    result.only({"models"});
    const auto& models = result.required("models");
    if (models.type != msgpack::type::ARRAY) detail::malformed("describe models must be a list");
    std::vector<ModelDescription> described;
    for (std::uint32_t i = 0; i < models.via.array.size; ++i) {
        detail::Fields model(models.via.array.ptr[i], "describe model");
        model.only({"name", "state", "inputs", "outputs"});
        described.push_back(ModelDescription{model.string("name"), model.string("state"),
                                             read_specs(model, "inputs"),
                                             read_specs(model, "outputs")});
    }
    return described;
}

}  // namespace inferd::wire
