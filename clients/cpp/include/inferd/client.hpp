// Clients of the infer and control sockets. Each object owns one ZeroMQ socket
// and is meant for one thread (ZeroMQ sockets are not thread-safe).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "inferd/endpoints.hpp"
#include "inferd/errors.hpp"
#include "inferd/events.hpp"
#include "inferd/poll_window.hpp"
#include "inferd/region.hpp"
#include "inferd/tensor.hpp"
#include "inferd/wire.hpp"

namespace zmq {
class context_t;
class message_t;
}  // namespace zmq

namespace inferd {

// The library's process-wide ZeroMQ context (one I/O thread), shared by default.
std::shared_ptr<zmq::context_t> shared_context();

struct ClientOptions {
    std::string endpoint;  // empty: the default for the socket
    std::chrono::milliseconds timeout{5000};  // per attempt: its send and its wait together
    int retries = 0;  // resends under a fresh id after a timeout
    std::string shm_socket;  // empty: next to the infer socket
    std::shared_ptr<zmq::context_t> context;  // null: shared_context()
    std::optional<ClientCurve> curve;  // for a tcp:// endpoint of a daemon with security.curve
    // Called before every send with the attempt's id and number (0 = first);
    // e.g. to log retries.
    std::function<void(std::uint64_t id, int attempt)> on_attempt;
    // The polling window before a reply on the shm socket is due, us (0..10000;
    // 0: none; DESIGN.md 113): InferenceClient::reply_spin() says what it cost.
    int reply_spin_us = 200;
    // SO_SNDBUF of the ipc:// connection to the infer socket (0..64 MiB; 0: the
    // kernel's default), so a tensor frame leaves in one write; the kernel caps
    // it at net.core.wmem_max (DESIGN.md 116). InferenceClient::send_buffer()
    // says what the connection got.
    int send_buffer_bytes = 2 * 1024 * 1024;
    // InferenceClient only: the largest reply frame the infer socket takes
    // (ZMQ_MAXMSGSIZE; the reply header, describe's included, and each output
    // sent as a frame; an output written into a registered region is not a
    // frame). Each infer request tells the daemon the bound, and the daemon
    // answers a reply that would not fit with RESOURCE_EXHAUSTED (RemoteError;
    // the request ran at most once, whatever the retries). A longer frame that comes all
    // the same (a daemon older than the field) ends the connection unread: the
    // call throws ConnectionLost and the next one connects anew. Unset: no bound. 1..2^63-34,
    // std::invalid_argument otherwise (and from OperatorClient, whose replies are
    // bounded to a header, wire::kMaxHeaderBytes, whatever this says). A bound
    // below the largest reply header (up to 64 KiB: describe with many models)
    // fails those replies.
    std::optional<std::int64_t> max_reply_frame_bytes;
};

// The kernel send buffer asked for the infer socket's connection and what it got.
struct SendBufferStatus {
    int bytes = 0;                       // ClientOptions::send_buffer_bytes
    std::uint64_t sized = 0;             // connections sized
    std::uint64_t capped = 0;            // of which the kernel capped (net.core.wmem_max)
    std::optional<int> effective_bytes;  // what the last one got
};

struct InferOptions {
    std::optional<std::chrono::milliseconds> timeout;  // default: ClientOptions::timeout
    std::optional<std::uint32_t> deadline_ms;  // absent: the model's default deadline
    std::optional<int> retries;  // default: ClientOptions::retries
    // Where to put outputs: a buffer in a registered region is written by the
    // daemon in place (no frame comes back); any other is filled from the frame.
    std::vector<NamedOutputBuffer> outputs;
};

// A reply to infer. `outputs` are views of the received frames (owned here, so
// valid while this object lives; a frame ZeroMQ delivered at an address
// misaligned for its dtype is copied once to an aligned one) or of the caller's
// buffers (InferOptions::outputs).
class InferResult {
public:
    wire::InferReply reply;  // model, runtime, fallback, latency_us, queue_us, late, thermal
    std::vector<NamedTensor> outputs;

    const TensorView& output(const std::string& name) const;

    InferResult();
    ~InferResult();
    InferResult(InferResult&&) noexcept;
    InferResult& operator=(InferResult&&) noexcept;

private:
    friend class InferenceClient;
    std::vector<zmq::message_t> frames_;
    std::vector<std::unique_ptr<unsigned char[]>> aligned_;  // copies of misaligned frames
};

struct TensorSpec {
    std::string name;
    DType dtype = DType::Float32;
    std::vector<std::optional<std::int64_t>> shape;  // nullopt: a dynamic dimension
    std::string profile_json;  // empty, or {min_shape, opt_shape, max_shape}
};

struct ModelDescription {
    std::string name;
    std::string state;
    std::vector<TensorSpec> inputs;
    std::vector<TensorSpec> outputs;
};

// A region this client registered that the daemon let go (it closed the shm
// connection: a restart) and that is not registered again yet.
struct PendingRegion {
    std::optional<std::string> label;
    std::size_t nbytes = 0;
    std::uint64_t failures = 0;  // failed tries to register it again, in a row
    std::string error;  // the last one's what() ("" before any)
    std::chrono::milliseconds retry_in{0};  // until a call naming it may try again
};

// The regions this client registered (InferenceClient::shm_regions()).
struct ShmRegions {
    std::size_t registered = 0;  // held by the daemon for this client now
    std::vector<PendingRegion> pending;
    std::uint64_t failed_registrations = 0;  // failed tries to register one again, in all
};

class RequestChannel;
class RegionChannel;

class InferenceClient {
public:
    // std::invalid_argument for a malformed endpoint or an option out of range.
    explicit InferenceClient(ClientOptions options = {});
    ~InferenceClient();
    InferenceClient(const InferenceClient&) = delete;
    InferenceClient& operator=(const InferenceClient&) = delete;

    // Runs `model` on `inputs`. An input that lives in a registered region is
    // sent by reference, any other as a frame (zero-copy: its memory must stay
    // untouched until infer returns). A request with every input in a region and
    // every output placed in one travels on the shm socket (one message each
    // way, no ZeroMQ) once a reply on the infer socket or describe() has named
    // the model's outputs, unless its header is over that socket's bound
    // (wire::kMaxShmMessageBytes). Throws RemoteError with the daemon's code,
    // Timeout, ConnectionLost (at once, or resent while retries are left), or
    // MalformedReply.
    //
    // Memory in regions is the daemon's from the send until the reply: it reads
    // the inputs and writes the placed outputs there whenever the request runs,
    // and so also after infer threw Timeout or ConnectionLost, for every attempt
    // the retries sent. unregister_region, or destroying the region or the
    // client, stops none of it (the daemon keeps a region mapped while a request
    // uses it; whatever still maps the memfd sees the writes). After a timeout,
    // do not reuse those buffers for anything that must not be overwritten until
    // that request's late reply has come (discarded and counted in
    // discarded_replies() by a later call on the same socket), or use others.
    // InferOptions::deadline_ms at or below the timeout makes the daemon answer
    // DEADLINE_EXCEEDED without running a request not started by then, but it
    // counts from the daemon's receipt (a request not read yet can still start
    // later) and never stops a run already started.
    //
    // A region the daemon let go and that cannot be registered again
    // (shm_regions()) fails no call: its tensors travel as frames.
    InferResult infer(const std::string& model, const std::vector<NamedTensor>& inputs,
                      const InferOptions& options = {});

    std::vector<ModelDescription> describe(std::optional<std::chrono::milliseconds> timeout = {});

    // A new region of at least nbytes, registered with the daemon and owned by
    // this client (released when it closes).
    SharedRegion& shared_region(std::size_t nbytes, std::optional<std::string> label = {});
    // Registers a region the caller owns (once); returns its id. The registration
    // follows the region when it is moved; a region destroyed (or assigned over)
    // while registered is no longer used from that moment and is unregistered at
    // this client's next call. It must not end while a call that uses it runs.
    // Should the daemon close the shm connection (a restart releases every region),
    // the call on the shm socket that finds it closed throws ClientError, and the
    // regions are pending: a call naming one's tensors registers it again (under a
    // new id), at most once per delay (1 s, doubling with each failure in a row,
    // up to 60 s), a call's tries (connects included) waiting at most its timeout
    // in all, on a new connection if the old one closed; after a try that gets no
    // connection or no answer, the call's other pending regions wait as long as
    // that one, untried. While it cannot, a region's tensors travel as frames
    // (shm_regions() says why). register_region
    // registers only `region`, on a new connection if the old one closed, so a
    // pending region never makes it fail; a pending `region` is tried at once and
    // its failure thrown.
    std::string register_region(SharedRegion& region);
    void unregister_region(SharedRegion& region);

    // Replies to ids no longer waited for (answers to attempts that timed out).
    std::uint64_t discarded_replies() const;
    const std::string& endpoint() const;
    // Which socket the last infer call sent its request on, "infer" or "shm", set
    // just before it is sent: also for a call that then threw (a timeout, a lost
    // connection, an error reply), so it names where a late reply would come; a
    // call refused before that leaves it ("" before any).
    const std::string& last_transport() const { return last_transport_; }
    // The regions registered now, those pending (the daemon let them go and they
    // are not registered again yet) and why, and the failed tries in all.
    ShmRegions shm_regions() const;
    // The shm replies' polling window: its width and what it caught and cost.
    PollWindowStatus reply_spin() const;
    // The kernel send buffer of the connection to the infer socket (DESIGN.md 116).
    SendBufferStatus send_buffer() const;
    // Connections to the infer socket that were up and ended (each makes the
    // socket anew; a call waiting on one threw ConnectionLost or was resent).
    std::uint64_t connections_lost() const;

private:
    std::unique_ptr<RequestChannel> channel_;
    ClientOptions options_;
    std::unique_ptr<RegionChannel> shm_;
    // Registered regions by id: their mappings, not the objects, which the caller
    // may move or destroy (an emptied mapping is unregistered at the next call).
    std::vector<std::pair<std::string, std::shared_ptr<const detail::RegionMapping>>> regions_;
    // Regions a closed shm connection released, to register again by a call
    // naming them (register_named), each with its failed tries in a row.
    struct Released {
        std::shared_ptr<const detail::RegionMapping> mapping;
        std::uint64_t failures = 0;
        std::string error;
        std::chrono::steady_clock::time_point retry_at{};  // epoch: the first call naming it
    };
    std::vector<Released> released_;
    std::uint64_t failed_registrations_ = 0;
    std::uint64_t closed_shm_discarded_ = 0;  // discarded_replies() of closed shm connections
    std::vector<std::unique_ptr<SharedRegion>> owned_;
    // Each model's output names, as the last reply on the infer socket (or
    // describe) named them: a request placing all of them may go on shm.sock.
    std::map<std::string, std::set<std::string>> output_names_;
    std::string last_transport_;

    // Unregisters the regions destroyed since the last call (without waiting).
    void release_ended_regions();
    // `give_up_at`: when the connect (if one is needed) and the registration stop
    // waiting (unset: each waits the client's timeout).
    std::string register_mapping(const std::shared_ptr<const detail::RegionMapping>& mapping,
                                 std::optional<std::chrono::steady_clock::time_point> give_up_at = {});
    // The shm connection is closed (the daemon's restart released its regions):
    // dropped, and its regions pending (released_).
    void shm_closed();
    // Registers again the pending regions one of these tensors lies in whose
    // delay has passed, all within `timeout` (the call's); one that fails stays
    // pending (its tensors go as frames). A refusal of one lets the next be
    // tried; no connection or no answer ends the tries (put_off).
    void register_named(const std::vector<NamedTensor>& inputs, const InferOptions& options,
                        std::chrono::milliseconds timeout);
    // Registers the pending region of `mapping` again, now; one that fails stays
    // pending, its failure counted and its next try put off, and is rethrown.
    std::string register_released(const std::shared_ptr<const detail::RegionMapping>& mapping,
                                  std::optional<std::chrono::steady_clock::time_point> give_up_at = {});
    // The regions of `due` after `failed`, not tried because its try found no
    // connection or no answer, wait as long as it does (not counted: no try of
    // theirs was made).
    void put_off(const std::vector<std::shared_ptr<const detail::RegionMapping>>& due,
                 std::size_t failed);
    bool places_every_output(const std::string& model,
                             const std::vector<wire::TensorDescriptor>& placed) const;
};

struct SwitchResult {
    std::string model;
    std::optional<std::string> from_runtime;
    std::string to_runtime;
    std::vector<std::string> active_providers;
    double prepare_ms = 0;
    double swap_ms = 0;
};

struct ModelStatus {
    std::string model;
    std::string state;
    std::optional<std::string> runtime;
    bool fallback = false;
    std::uint64_t requests = 0;
    std::uint64_t queue_depth = 0;
    std::uint64_t late_results = 0;
    std::map<std::string, std::uint64_t> responses;  // by code, "OK" included
};

struct Status {
    std::string state;
    std::vector<ModelStatus> models;
    std::string json;  // the whole result (status_reply.json), for everything else
};

// The control socket: read-only ops for any admitted peer, operator ops
// (runtime.switch, build.*) for operators only (PERMISSION_DENIED otherwise).
// A reply is one header: a frame over wire::kMaxHeaderBytes ends the connection
// unread and the call throws ConnectionLost.
class OperatorClient {
public:
    explicit OperatorClient(ClientOptions options = {});
    ~OperatorClient();
    OperatorClient(const OperatorClient&) = delete;
    OperatorClient& operator=(const OperatorClient&) = delete;

    Status status();
    HealthSnapshot health();
    SwitchResult switch_runtime(const std::string& model, const std::string& runtime,
                                const std::optional<std::string>& requested_by = {});
    // Any other op; returns its result as JSON text.
    std::string call(const std::string& op, const wire::ControlArguments& arguments = {},
                     std::optional<std::chrono::milliseconds> timeout = {});
    // Connections to the control socket that were up and ended (see
    // InferenceClient::connections_lost; a call is never resent).
    std::uint64_t connections_lost() const;

private:
    std::string call_msgpack(const std::string& op, const wire::ControlArguments& arguments,
                             std::optional<std::chrono::milliseconds> timeout);
    std::unique_ptr<RequestChannel> channel_;
};

}  // namespace inferd

namespace inferd::wire {

// The `result` of a control reply (ControlReply::result_msgpack) as the client
// decodes it; MalformedReply when it breaks its schema.
HealthSnapshot decode_health_result(const void* data, std::size_t size);
SwitchResult decode_switch_result(const void* data, std::size_t size);
std::vector<ModelDescription> decode_describe_result(const void* data, std::size_t size);

}  // namespace inferd::wire
