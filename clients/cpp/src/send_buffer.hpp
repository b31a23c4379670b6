// The kernel send buffer of a socket's ipc:// connections (DESIGN.md 116): the
// Python client's inferd_wire/send_buffer.py, for the C++ client.
#pragma once

#include <zmq.hpp>

#include <string>

#include "inferd/client.hpp"

namespace inferd::detail {

// A Unix stream socket holds at most SO_SNDBUF unread bytes (208 KiB by
// default) before its writer waits, so ZeroMQ's I/O threads pass a 0.6 MB
// tensor in four writes and as many wake-ups. libzmq sizes tcp:// connections
// alone; for ipc:// this sets SO_SNDBUF on each connection the socket's monitor
// reports (ZMQ_EVENT_CONNECTED carries its descriptor). A descriptor is touched
// only when it is a Unix stream socket connected to the endpoint's path, so an
// event read after its connection closed (and the number was reused) sizes
// nothing else. tcp:// is left to the kernel's own tuning.
class SendBuffer {
public:
    SendBuffer(const std::string& endpoint, int nbytes);
    // Before the socket connects.
    void watch(zmq::context_t& context, zmq::socket_t& socket);
    // Sizes the connections reported since the last call (after each reply).
    void apply();
    // Before the socket closes.
    void close(zmq::socket_t& socket);
    // Sizes `fd` if it is one of the endpoint's connections; whether it was.
    bool size(int fd);
    const SendBufferStatus& status() const { return status_; }

private:
    std::string address_;  // getpeername's sun_path for the endpoint; empty: not ipc://
    zmq::socket_t monitor_;
    bool watching_ = false;
    SendBufferStatus status_;
};

}  // namespace inferd::detail
