#include "send_buffer.hpp"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstddef>
#include <stdexcept>

namespace inferd::detail {

namespace {

constexpr int kMaxSendBufferBytes = 64 * 1024 * 1024;

std::string ipc_address(const std::string& endpoint) {
    const std::string scheme = "ipc://";
    if (endpoint.rfind(scheme, 0) != 0) return {};
    auto path = endpoint.substr(scheme.size());
    if (!path.empty() && path[0] == '@') path[0] = '\0';  // the abstract namespace
    return path;
}

int socket_option(int fd, int name) {
    int value = 0;
    socklen_t length = sizeof value;
    if (getsockopt(fd, SOL_SOCKET, name, &value, &length) != 0) return -1;
    return value;
}

}  // namespace

SendBuffer::SendBuffer(const std::string& endpoint, int nbytes) : address_(ipc_address(endpoint)) {
    if (nbytes < 0 || nbytes > kMaxSendBufferBytes) {
        throw std::invalid_argument("send_buffer_bytes must be 0.." +
                                    std::to_string(kMaxSendBufferBytes) + ", got " +
                                    std::to_string(nbytes));
    }
    status_.bytes = nbytes;
}

bool SendBuffer::size(int fd) {
    if (socket_option(fd, SO_DOMAIN) != AF_UNIX || socket_option(fd, SO_TYPE) != SOCK_STREAM) {
        return false;
    }
    sockaddr_un peer{};
    socklen_t length = sizeof peer;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return false;
    std::size_t name_length = length > offsetof(sockaddr_un, sun_path)
                                  ? length - offsetof(sockaddr_un, sun_path)
                                  : 0;
    std::string name(peer.sun_path, name_length);
    if (!name.empty() && name[0] != '\0') name = name.c_str();  // a path: up to its NUL
    if (name != address_) return false;
    int asked = status_.bytes;
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &asked, sizeof asked) != 0) return false;
    int effective = socket_option(fd, SO_SNDBUF);
    if (effective < 0) return false;
    effective /= 2;  // the kernel keeps twice the size asked, for its bookkeeping
    ++status_.sized;
    status_.effective_bytes = effective;
    if (effective < status_.bytes) ++status_.capped;
    return true;
}

}  // namespace inferd::detail
