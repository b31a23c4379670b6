// The kernel send buffer of a socket's ipc:// connections (DESIGN.md 116): the
// Python client's inferd_wire/send_buffer.py, for the C++ client.
#pragma once

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
// nothing else. tcp:// is left to the kernel's own tuning. The descriptors
// come from the socket's ConnectionWatch (libzmq keeps one monitor per socket).
class SendBuffer {
public:
    SendBuffer(const std::string& endpoint, int nbytes);
    // Whether the socket's connections are to be sized (an ipc:// endpoint, a size asked).
    bool wanted() const { return status_.bytes != 0 && !address_.empty(); }
    // Sizes `fd` if it is one of the endpoint's connections; whether it was.
    bool size(int fd);
    const SendBufferStatus& status() const { return status_; }

private:
    std::string address_;  // getpeername's sun_path for the endpoint; empty: not ipc://
    SendBufferStatus status_;
};

}  // namespace inferd::detail
