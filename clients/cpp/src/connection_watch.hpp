// What a socket's connection does, as zmq_socket_monitor reports it (internal):
// one watch per socket, since libzmq keeps one monitor per socket (a second
// zmq_socket_monitor replaces the first). The events subscriber (DESIGN.md 242)
// and the request channels of InferenceClient and OperatorClient use it; the request channel's
// send-buffer sizing (DESIGN.md 116) takes its CONNECTED news through it too.
#pragma once

#include <zmq.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "inferd/errors.hpp"

namespace inferd::detail {

// CURVE's MESSAGE command around a frame (entry 238): a ZMQ_MAXMSGSIZE over
// CURVE bounds the frame and this, so a bound of N is N + this there.
constexpr std::int64_t kCurveFrameOverhead = 33;

class ConnectionWatch {
public:
    // What check() read since the last one.
    struct News {
        std::uint64_t lost = 0;  // connections that were up (handshake done) and ended
        bool retried = false;    // libzmq is connecting again itself (CONNECT_RETRIED after the last loss)
        // The ZAP status code of a handshake the daemon refused (HANDSHAKE_FAILED_AUTH:
        // 400, or 500 when its handler failed), unless a later handshake read in the
        // same check succeeded (the refusal is stale then). libzmq never connects
        // such a socket again: the caller decides (the request channel and the
        // events subscriber throw refused_error).
        std::optional<int> refused;
    };

    ConnectionWatch() = default;
    // Watches `socket`, before it connects (to see its first handshake).
    // `connected`, when given, gets each new connection's descriptor
    // (ZMQ_EVENT_CONNECTED).
    ConnectionWatch(zmq::context_t& context, zmq::socket_t& socket,
                    std::function<void(int)> connected = {});
    ~ConnectionWatch() { stop(); }
    ConnectionWatch(ConnectionWatch&&) = delete;
    ConnectionWatch& operator=(ConnectionWatch&&) = delete;

    // Reads all the news (the monitor's descriptor is edge-triggered).
    News check();
    // Stops monitoring, before the socket closes: news libzmq sent as it closed
    // was never freed otherwise (LSan: 77 bytes, in 7 runs of 30).
    void stop() noexcept;
    zmq::socket_t& monitor() { return monitor_; }

private:
    void* socket_ = nullptr;  // the watched socket's handle; null once stopped
    zmq::socket_t monitor_;   // a PAIR receiving the news
    std::function<void(int)> connected_;
    bool up_ = false;  // a connection's handshake succeeded and it has not ended
};

// Waits until `socket` has `events` (ZMQ_POLLIN: a message; ZMQ_POLLOUT: room to
// send) or `monitor` has news, for at most `timeout_ms`; ends early when a signal
// handler ran (zmq_poll's EINTR, as poll_in), and the caller looks and waits again
// for the time left. Whether `monitor` had news.
bool wait_either(zmq::socket_t& socket, zmq::socket_t& monitor, long long timeout_ms,
                 short events = ZMQ_POLLIN);

// Reads one message's parts into `parts` (cleared first) without waiting; false
// when none is there. zmq_msg_recv fails EINTR when a signal handler ran while
// libzmq looked at its mailbox (on an empty socket, and at every 100th part read:
// inbound_poll_rate); cppzmq throws that as zmq::error_t, which recv_multipart let
// through, losing the parts read so far: the next read took the rest of the
// message for a message. Such a failure took no part, so the first part's is
// "none yet" (the caller waits, and a message there ends the wait at once) and a
// later part's is asked again (a message is delivered whole, so it is there). A
// signal handler cannot throw in C++, so the retry is exact.
bool recv_message(zmq::socket_t& socket, std::vector<zmq::message_t>& parts);

// Disconnects `socket` from `endpoint`: ends libzmq's connection or its attempt
// (after a refusal: no more tries while the caller makes room). One libzmq no
// longer knows is left as it is.
void disconnect_from(zmq::socket_t& socket, const std::string& endpoint);

// The ConnectionRefused for a connection to `endpoint` the daemon refused at its
// handshake with ZAP `status`; `anew` says what connects again (the next call,
// the next receive). The handshake carries the status alone: the daemon's reason
// (its ZAP reply's status text) is only in its log.
ConnectionRefused refused_error(const std::string& endpoint, int status, const std::string& anew);

// The ClientError for a socket to `endpoint`, or its monitor, that ZeroMQ could
// not make (EMFILE at the descriptor limit, a terminated context): "cannot make a
// socket for <endpoint>: errno N: <text>", as RegionChannel says of its own.
ClientError socket_error(const std::string& endpoint, const zmq::error_t& error);

}  // namespace inferd::detail
