#include "inferd/region.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <variant>

#include "decode.hpp"
#include "internal.hpp"
#include "inferd/endpoints.hpp"
#include "inferd/errors.hpp"
#include "region_channel.hpp"

namespace inferd {
namespace {

std::string system_error(const std::string& what) { return what + ": " + std::strerror(errno); }

std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

}  // namespace

SharedRegion::SharedRegion(std::size_t nbytes, std::optional<std::string> label)
    : label_(std::move(label)) {
    if (nbytes == 0) throw ClientError("a region needs a positive size");
    auto page = page_size();
    size_ = (nbytes + page - 1) / page * page;
    std::string name = "inferd-" + label_.value_or("region");
    fd_ = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd_ < 0) throw ClientError(system_error("memfd_create"));
    // Sealed against shrinking (what the daemon requires: it can then never fault
    // on the memory), growing, and further sealing.
    if (ftruncate(fd_, static_cast<off_t>(size_)) != 0 ||
        fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        auto message = system_error("sealing the region");
        release();
        throw ClientError(message);
    }
    map();
}

namespace {

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1, include/uapi/linux/fcntl.h
#endif

std::string size_problem(off_t size) {
    auto page = page_size();
    if (size > 0 && static_cast<std::size_t>(size) % page == 0) return {};
    return "the memfd holds " + std::to_string(size) +
           " bytes; a region must be a positive multiple of the page size (" +
           std::to_string(page) + ")";
}

// Why `fd` cannot be adopted, empty once it is sealed against shrinking and its size
// is in `size`. Seals belong to the memfd, not to this descriptor, and cannot be
// taken back: every check that can refuse it comes first, so a refused memfd is
// left to its maker as it came.
std::string seal_for_adoption(int fd, std::size_t& size) {
    if (fd < 0) return "descriptor " + std::to_string(fd) + " cannot be a region: it is not a descriptor";
    int seals = fcntl(fd, F_GET_SEALS);
    int flags = seals < 0 ? -1 : fcntl(fd, F_GETFL);
    struct stat info {};
    if (seals < 0 || flags < 0 || fstat(fd, &info) != 0) {
        return "descriptor " + std::to_string(fd) + " cannot be a region (" +
               std::strerror(errno) + "): it must be a memfd";
    }
    if ((flags & O_ACCMODE) != O_RDWR) {
        return "descriptor " + std::to_string(fd) +
               " is not open read-write: outputs are written into regions";
    }
    if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
        return "the memfd is sealed against writing (seals " + std::to_string(seals) +
               "): outputs are written into regions";
    }
    if (auto problem = size_problem(info.st_size); !problem.empty()) return problem;
    if (!(seals & F_SEAL_SHRINK)) {
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
            return std::string("the memfd cannot be sealed against shrinking (") +
                   std::strerror(errno) +
                   "): it must be created with MFD_ALLOW_SEALING and not sealed with F_SEAL_SEAL";
        }
        // Its maker may have resized it between the check and the seal; now it cannot.
        if (fstat(fd, &info) != 0) return system_error("fstat");
        if (auto problem = size_problem(info.st_size); !problem.empty()) return problem;
    }
    size = static_cast<std::size_t>(info.st_size);
    return {};
}

}  // namespace

SharedRegion SharedRegion::adopt(int fd, std::optional<std::string> label) {
    SharedRegion region;
    region.fd_ = fd;  // owned from here: closed by release() on every refusal
    region.label_ = std::move(label);
    if (auto problem = seal_for_adoption(fd, region.size_); !problem.empty()) {
        region.release();
        throw ClientError(problem);
    }
    region.map();
    return region;
}

void SharedRegion::map() {
    base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (base_ == MAP_FAILED) {
        base_ = nullptr;
        auto message = system_error("the memfd cannot be mapped read-write: mmap");
        release();
        throw ClientError(message);
    }
    // Transparent huge pages where the kernel's shmem policy allows them (as
    // inferd_wire.regions.advise_huge_pages): a big tensor's copies then miss
    // the TLB far less. Advice only: a kernel without THP keeps 4 KiB pages.
    (void)madvise(base_, size_, MADV_HUGEPAGE);
    mapping_ = std::make_shared<detail::RegionMapping>(detail::RegionMapping{base_, size_, fd_, label_});
}

SharedRegion::~SharedRegion() { release(); }

SharedRegion::SharedRegion(SharedRegion&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      base_(std::exchange(other.base_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      used_(std::exchange(other.used_, 0)),
      label_(std::move(other.label_)),
      mapping_(std::move(other.mapping_)) {}

SharedRegion& SharedRegion::operator=(SharedRegion&& other) noexcept {
    if (this != &other) {
        release();
        fd_ = std::exchange(other.fd_, -1);
        base_ = std::exchange(other.base_, nullptr);
        size_ = std::exchange(other.size_, 0);
        used_ = std::exchange(other.used_, 0);
        label_ = std::move(other.label_);
        mapping_ = std::move(other.mapping_);
    }
    return *this;
}

void SharedRegion::release() noexcept {
    // A client that registered the region stops finding tensors in it from here
    // (and unregisters it at its next call).
    if (mapping_) {
        mapping_->base = nullptr;
        mapping_->fd = -1;
    }
    mapping_.reset();
    if (base_ != nullptr) munmap(base_, size_);
    if (fd_ >= 0) close(fd_);
    base_ = nullptr;
    fd_ = -1;
}

MutableTensorView SharedRegion::allocate(DType dtype, const Shape& shape) {
    if (base_ == nullptr) throw ClientError("the shared region is closed");
    auto nbytes = tensor_bytes(dtype, shape);  // checked: never wraps
    auto offset = (used_ + wire::kRegionAlignment - 1) / wire::kRegionAlignment * wire::kRegionAlignment;
    // Written so that nothing wraps: offset + nbytes could.
    if (nbytes > size_ || offset > size_ - nbytes) {
        throw ClientError("the region has " + std::to_string(size_ - std::min(offset, size_)) +
                          " bytes left; the tensor needs " + std::to_string(nbytes));
    }
    used_ = offset + nbytes;
    return MutableTensorView{dtype, shape, static_cast<char*>(base_) + offset, nbytes};
}

std::optional<std::size_t> SharedRegion::locate(const void* data, std::size_t nbytes) const {
    return mapping_ ? mapping_->locate(data, nbytes) : std::nullopt;
}

std::optional<std::size_t> detail::RegionMapping::locate(const void* data, std::size_t nbytes) const {
    if (base == nullptr || data == nullptr) return std::nullopt;
    auto start = reinterpret_cast<std::uintptr_t>(data);
    auto first = reinterpret_cast<std::uintptr_t>(base);
    if (start < first || nbytes > size || start - first > size - nbytes) return std::nullopt;
    auto offset = static_cast<std::size_t>(start - first);
    if (offset % wire::kRegionAlignment) return std::nullopt;
    return offset;
}

namespace {

// What the channel reads of any reply before it knows whose it is.
struct Envelope {
    wire::RequestId id;
    bool ok = false;  // `ok` is true (false also when it is missing or not a boolean)
    std::optional<std::string> region;  // result.region, when the result names one
};

Envelope read_envelope(const std::string& reply) {
    auto handle = detail::unpack(reply.data(), reply.size(), wire::kMaxShmMessageBytes);
    detail::Fields header(handle.get(), "reply");
    Envelope envelope;
    envelope.id = detail::read_envelope(header, true);
    const auto* ok = header.find("ok");
    envelope.ok = ok != nullptr && ok->type == msgpack::type::BOOLEAN && ok->via.boolean;
    const auto* result = header.find("result");
    if (envelope.ok && result != nullptr && result->type == msgpack::type::MAP) {
        const auto* region = detail::Fields(*result, "result").find("region");
        if (region != nullptr && region->type == msgpack::type::STR) {
            envelope.region.emplace(region->via.str.ptr, region->via.str.size);
        }
    }
    return envelope;
}

}  // namespace

RegionChannel::RegionChannel(const std::string& path, std::chrono::milliseconds timeout,
                             int reply_spin_us, std::function<std::uint64_t()> next_id,
                             std::optional<std::chrono::milliseconds> connect_timeout)
    : path_(path), timeout_(timeout), next_id_(std::move(next_id)), spin_(reply_spin_us) {
    check_client_endpoint("ipc://" + path);  // the same trust rule as for the ipc sockets
    fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw ClientError(system_error("socket"));
    // SO_SNDTIMEO bounds connect(2) (a listener whose backlog is full); 0 would be
    // no bound at all, so a timeout of 0 waits a millisecond. Sends are
    // non-blocking and waited for against each call's own deadline (send_message).
    auto bound = std::max(connect_timeout.value_or(timeout), std::chrono::milliseconds(1));
    timeval wait{};
    wait.tv_sec = static_cast<time_t>(bound.count() / 1000);
    wait.tv_usec = static_cast<suseconds_t>((bound.count() % 1000) * 1000);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &wait, sizeof wait);
    sockaddr_un address{};  // check_client_endpoint refused a path sun_path cannot hold
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
        auto message = system_error("cannot connect to the shm socket " + path);
        close(fd_);
        throw ClientError(message);
    }
}

RegionChannel::~RegionChannel() {
    if (fd_ >= 0) close(fd_);
}

std::string RegionChannel::register_region(const std::shared_ptr<const detail::RegionMapping>& region,
                                           std::optional<std::chrono::milliseconds> timeout) {
    registering_ = region.get();
    adopted_.reset();
    struct Registered {  // however it ends
        RegionChannel& channel;
        ~Registered() { channel.registering_ = nullptr; }
    } registered{*this};
    if (!late_registrations_.empty()) {
        read_queued();
        if (adopted_) return *adopted_;
    }
    wire::ControlArguments arguments;
    if (region->label) arguments.emplace_back("label", *region->label);
    std::string result;
    try {
        result = call("register", arguments, region->fd, timeout, region);
    } catch (const ClientError&) {
        // The late one came while this waited: the region is registered, unless
        // the connection, and all it registered, is gone.
        if (!adopted_ || hung_up()) throw;
        return *adopted_;
    }
    auto handle = detail::unpack(result.data(), result.size(), wire::kMaxShmMessageBytes);
    detail::Fields fields(handle.get(), "register result");
    auto id = fields.string("region");
    if (!adopted_) return id;
    release(id);  // made twice after all: one copy goes
    return *adopted_;
}

void RegionChannel::unregister_region(const std::string& region_id) {
    call("unregister", {{"region", region_id}}, -1);
}

void RegionChannel::release(const std::string& region_id) {
    auto request_id = next_id_();
    // Not sent (the daemon not reading, or gone): closing the connection releases
    // it, and the next call sees the closed connection for itself.
    auto message = wire::encode_control_request(request_id, "unregister", {{"region", region_id}});
    (void)send_message(message, -1, detail::deadline_after(timeout_));
}

// {v, op, ...arguments, id} as the control requests (the Python client sends
// {v, id, op, ...}; the daemon reads keys, not their order).
std::string RegionChannel::call(const std::string& op, const wire::ControlArguments& arguments,
                                int fd, std::optional<std::chrono::milliseconds> timeout,
                                std::weak_ptr<const detail::RegionMapping> region) {
    auto request_id = next_id_();
    auto give_up_at = detail::deadline_after(timeout.value_or(timeout_));
    if (!send_message(wire::encode_control_request(request_id, op, arguments), fd, give_up_at)) {
        throw Timeout("the daemon does not read the shm socket " + path_);
    }
    // A registration sent and not answered (a timeout, or a wait that failed on
    // another message) may still be made: its late reply names the region to free.
    std::optional<std::string> reply;
    try {
        reply = await(request_id, give_up_at);
    } catch (...) {
        if (op == "register") late_registrations_.emplace(request_id, region);
        throw;
    }
    if (!reply) {
        if (op == "register") late_registrations_.emplace(request_id, std::move(region));
        throw Timeout("no reply from " + path_);
    }
    auto decoded = wire::decode_control_reply(reply->data(), reply->size());
    if (!decoded.ok) {
        // Ours are always readable: a null id is the connection's refusal at
        // connect (a limit, the allow-list), which the daemon then closes.
        refused_ = refused_ || std::holds_alternative<std::monostate>(decoded.id);
        throw RemoteError(decoded.error->code, decoded.error->message);
    }
    return decoded.result_msgpack;
}

bool RegionChannel::hung_up() const {
    if (refused_ || failed_) return true;
    pollfd peer{fd_, POLLRDHUP, 0};  // POLLHUP and POLLERR are always reported
    return poll(&peer, 1, 0) > 0 && (peer.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL));
}

std::string RegionChannel::failed(const std::string& what) {
    failed_ = true;
    return what + " (the regions registered there are released; the client's next call naming "
                  "them registers them again)";
}

std::string RegionChannel::request(const std::string& model,
                                   const std::function<std::string(std::uint64_t)>& encode,
                                   const std::function<void(std::uint64_t, int)>& on_attempt,
                                   std::chrono::milliseconds timeout, int retries) {
    auto& arrivals = arrivals_[model];
    for (int attempt = 0; attempt <= retries; ++attempt) {
        auto request_id = next_id_();
        if (on_attempt) on_attempt(request_id, attempt);
        // The attempt's timeout bounds its send and its wait together.
        auto give_up_at = detail::deadline_after(timeout);
        if (!send_message(encode(request_id), -1, give_up_at)) continue;
        auto sent = Clock::now();
        bool ready = spin_.wait(fd_, arrivals, sent, give_up_at);
        if (auto reply = await(request_id, give_up_at, ready)) {
            arrivals.observed(
                std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - sent).count(),
                spin_.width_ns());
            return *reply;
        }
    }
    throw Timeout("no reply from " + path_ + " within " + std::to_string(timeout.count()) +
                  " ms after " + std::to_string(retries + 1) + " attempt(s)");
}

bool RegionChannel::send_message(const std::string& message, int fd, Clock::time_point give_up_at) {
    if (message.size() > wire::kMaxShmMessageBytes) {
        // The daemon would read none of it, its id included: its refusal would
        // carry no id (see await).
        throw ClientError("a message of " + std::to_string(message.size()) +
                          " bytes cannot go on the shm socket " + path_ +
                          ", whose messages hold at most " +
                          std::to_string(wire::kMaxShmMessageBytes) + " bytes");
    }
    iovec part{const_cast<char*>(message.data()), message.size()};
    msghdr header{};
    header.msg_iov = &part;
    header.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
        header.msg_control = control;
        header.msg_controllen = sizeof control;
        auto* ancillary = CMSG_FIRSTHDR(&header);
        ancillary->cmsg_level = SOL_SOCKET;
        ancillary->cmsg_type = SCM_RIGHTS;
        ancillary->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(ancillary), &fd, sizeof(int));
    }
    // Non-blocking, and waited for until the caller's deadline: SO_SNDTIMEO would
    // be one bound for every call (and 0 there is none at all).
    while (sendmsg(fd_, &header, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
        if (errno == EINTR) continue;
        // A connection refused at connect (shm.max_connections) has its refusal
        // queued for us: a send that failed otherwise still reads the reply.
        if (errno != EAGAIN && errno != EWOULDBLOCK) break;
        auto left = detail::milliseconds_left(give_up_at);
        if (left <= 0) return false;
        pollfd writable{fd_, POLLOUT, 0};
        if (poll(&writable, 1, static_cast<int>(left)) < 0 && errno != EINTR) break;
    }
    return true;
}

void RegionChannel::discard(const wire::RequestId& id, bool ok,
                            const std::optional<std::string>& region) {
    const auto* number = std::get_if<std::uint64_t>(&id);
    auto late = number == nullptr ? late_registrations_.end() : late_registrations_.find(*number);
    if (late == late_registrations_.end()) {
        ++discarded_;
        return;
    }
    auto made_for = late->second.lock();
    late_registrations_.erase(late);
    if (ok && region && made_for && made_for.get() == registering_ && !adopted_) {
        adopted_ = *region;  // the registration register_region makes now
        return;
    }
    ++discarded_;
    // The daemon made a registration the caller was told had timed out: nobody
    // knows its id but this reply, so it is let go here. Its answer is not waited
    // for (a reply awaited here could be the one the current call waits for).
    if (ok && region) release(*region);
}

void RegionChannel::read_queued() {
    pollfd readable{fd_, POLLIN, 0};
    while (poll(&readable, 1, 0) > 0) {  // a closed connection is ready too: next_message throws
        auto message = next_message(Clock::now(), true);  // a deadline now: never waits
        if (!message) return;
        auto envelope = read_envelope(*message);
        if (std::holds_alternative<std::monostate>(envelope.id)) {
            ++discarded_;  // an error of a message given up on: nobody waits for it
            continue;
        }
        discard(envelope.id, envelope.ok, envelope.region);
    }
}

std::optional<std::string> RegionChannel::await(std::uint64_t request_id, Clock::time_point give_up_at,
                                                bool ready_now) {
    while (true) {
        auto reply = next_message(give_up_at, ready_now);
        ready_now = false;
        if (!reply) return std::nullopt;
        auto envelope = read_envelope(*reply);
        if (std::holds_alternative<std::monostate>(envelope.id) && !envelope.ok) {
            // Every message sent here is one the daemon reads whole (send_message)
            // and answers under its id: an error without one is the connection's
            // refusal at connect, the answer of the call that waits now. (Taken for
            // the late answer of one that timed out, it left this call to time out.)
            return reply;
        }
        if (envelope.id == wire::RequestId{request_id}) return reply;
        discard(envelope.id, envelope.ok, envelope.region);
    }
}

std::optional<std::string> RegionChannel::next_message(Clock::time_point give_up_at, bool ready_now) {
    while (true) {
        if (!ready_now) {
            auto left = detail::milliseconds_left(give_up_at);
            if (left <= 0) return std::nullopt;
            pollfd readable{fd_, POLLIN, 0};
            auto ready = poll(&readable, 1, static_cast<int>(left));
            if (ready < 0 && errno == EINTR) continue;
            if (ready < 0) throw ClientError(failed(system_error("the shm socket " + path_ + " failed")));
            if (ready == 0) return std::nullopt;
        }
        ready_now = false;
        std::string reply(wire::kMaxShmMessageBytes, '\0');
        auto received = recv(fd_, reply.data(), reply.size(), MSG_DONTWAIT);
        if (received < 0 && errno == ECONNRESET) {
            // Reported once when the daemon closed the connection with our message
            // unread; what it sent before closing is still there.
            received = recv(fd_, reply.data(), reply.size(), MSG_DONTWAIT);
            if (received < 0) received = 0;
        }
        if (received < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (received < 0) throw ClientError(failed(system_error("the shm socket " + path_ + " failed")));
        if (received == 0) throw ClientError(failed("the daemon closed the shm socket " + path_));
        reply.resize(static_cast<std::size_t>(received));
        return reply;
    }
}

}  // namespace inferd
