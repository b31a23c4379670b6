#include "connection_watch.hpp"

#include <zmq_addon.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace inferd::detail {

namespace {

constexpr int kConnection = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED |
                            ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
// Names each monitor's endpoint (inproc://, unique in the process).
std::atomic<std::uint64_t> monitors{0};

}  // namespace

ConnectionWatch::ConnectionWatch(zmq::context_t& context, zmq::socket_t& socket,
                                 std::function<void(int)> connected)
    : connected_(std::move(connected)) {
    auto address = "inproc://inferd-monitor-" + std::to_string(monitors++);
    int events = kConnection | (connected_ ? ZMQ_EVENT_CONNECTED : 0);
    if (zmq_socket_monitor(socket.handle(), address.c_str(), events) != 0) throw zmq::error_t();
    socket_ = socket.handle();
    try {
        monitor_ = zmq::socket_t(context, zmq::socket_type::pair);
        monitor_.set(zmq::sockopt::linger, 0);
        monitor_.connect(address);
    } catch (...) {
        stop();
        throw;
    }
}

ClientError socket_error(const std::string& endpoint, const zmq::error_t& error) {
    return ClientError("cannot make a socket for " + endpoint + ": errno " + std::to_string(error.num()) +
                       ": " + error.what());
}

ConnectionWatch::News ConnectionWatch::check() {
    News news;
    if (socket_ == nullptr) return news;
    std::vector<zmq::message_t> parts;
    while (recv_message(monitor_, parts)) {
        // [event (16 bits) and value (32 bits), endpoint]
        std::uint16_t event = 0;
        std::int32_t value = -1;
        if (!parts.empty() && parts[0].size() >= sizeof event + sizeof value) {
            std::memcpy(&event, parts[0].data(), sizeof event);
            std::memcpy(&value, static_cast<const char*>(parts[0].data()) + sizeof event,
                        sizeof value);
        }
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            up_ = true;
            // A refusal read before it is stale: this socket's connection is up,
            // and is not made anew for it (as the Python watch, DESIGN.md 325).
            news.refused.reset();
        } else if (event == ZMQ_EVENT_DISCONNECTED && up_) {
            up_ = false;
            ++news.lost;
            news.retried = false;
        } else if (event == ZMQ_EVENT_CONNECT_RETRIED) {
            news.retried = true;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            news.refused = value;
        } else if (event == ZMQ_EVENT_CONNECTED && connected_) {
            connected_(value);
        }
    }
    return news;
}

void ConnectionWatch::stop() noexcept {
    if (socket_ == nullptr) return;
    (void)zmq_socket_monitor(socket_, nullptr, 0);
    socket_ = nullptr;
    monitor_.close();
}

bool wait_either(zmq::socket_t& socket, zmq::socket_t& monitor, long long timeout_ms,
                 short events) {
    std::array<zmq::pollitem_t, 2> items{{{socket.handle(), 0, events, 0},
                                          {monitor.handle(), 0, ZMQ_POLLIN, 0}}};
    try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(std::max(0LL, timeout_ms)));
    } catch (const zmq::error_t& error) {
        if (error.num() != EINTR) throw;
        return false;
    }
    return (items[1].revents & ZMQ_POLLIN) != 0;
}

bool recv_message(zmq::socket_t& socket, std::vector<zmq::message_t>& parts) {
    parts.clear();
    while (true) {
        zmq::message_t part;
        try {
            if (!socket.recv(part, zmq::recv_flags::dontwait)) {
                if (parts.empty()) return false;
                continue;  // not expected: the rest of a message is there with its first part
            }
        } catch (const zmq::error_t& error) {
            if (error.num() != EINTR) throw;
            if (parts.empty()) return false;
            continue;
        }
        const bool more = part.more();
        parts.push_back(std::move(part));
        if (!more) return true;
    }
}

void disconnect_from(zmq::socket_t& socket, const std::string& endpoint) {
    try {
        socket.disconnect(endpoint);
    } catch (const zmq::error_t&) {
        // no longer known to libzmq
    }
}

ConnectionRefused refused_error(const std::string& endpoint, int status, const std::string& anew) {
    return ConnectionRefused(
        "the daemon at " + endpoint + " refused this client's connection at its handshake (ZAP "
        "status " + std::to_string(status) + "): its access policy does not admit this client, "
        "or this peer (a local user, a remote host) already holds bus.max_connections "
        "connections to that socket; the daemon's log says why (peer_refused), status counts "
        "it (security.sockets.<socket>.connections_refused); " + anew,
        status);
}

}  // namespace inferd::detail
