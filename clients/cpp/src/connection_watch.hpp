// What a socket's connection does, as zmq_socket_monitor reports it (internal):
// one watch per socket, since libzmq keeps one monitor per socket (a second
// zmq_socket_monitor replaces the first). The events subscriber (DESIGN.md 242)
// and the request channels of InferenceClient and OperatorClient use it; the request channel's
// send-buffer sizing (DESIGN.md 116) takes its CONNECTED news through it too.
#pragma once

#include <zmq.hpp>

#include <cstdint>
#include <functional>

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

// Waits until `socket` or `monitor` has something, for at most `timeout_ms`;
// ends early when a signal handler ran (zmq_poll's EINTR, as poll_in), and the
// caller looks and waits again for the time left. Whether `monitor` had news.
bool wait_either(zmq::socket_t& socket, zmq::socket_t& monitor, long long timeout_ms);

}  // namespace inferd::detail
