// The exceptions the client raises. Every one derives from ClientError; an error
// reply from the daemon (RemoteError) and no reply at all (Timeout) are distinct.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace inferd {

// error.code of an error reply (protocol.Code, schemas/bus/common.json#/$defs/error_code).
enum class ErrorCode {
    InvalidArgument,
    NotFound,
    Unavailable,
    DeadlineExceeded,
    ResourceExhausted,
    PermissionDenied,
    FailedPrecondition,
    Cancelled,
    Internal,
};

std::string_view error_code_name(ErrorCode code);
// The code of a wire name; false when the name is not one of the protocol's codes.
bool parse_error_code(std::string_view name, ErrorCode& code);

class ClientError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// The daemon answered with ok: false.
class RemoteError : public ClientError {
public:
    RemoteError(ErrorCode code, std::string message);
    ErrorCode code() const noexcept { return code_; }
    const std::string& message() const noexcept { return message_; }

private:
    ErrorCode code_;
    std::string message_;
};

// No reply arrived within the timeout, after every allowed retry.
class Timeout : public ClientError {
public:
    using ClientError::ClientError;
};

// The connection ended while a request waited for its reply: a reply frame over
// the client's bound (ClientOptions::max_reply_frame_bytes, or a header's for
// OperatorClient: libzmq ends the connection as the frame's length arrives,
// unread), or the daemon closed it (it stopped or restarted, or a request frame
// was over its ZMQ_MAXMSGSIZE); the client's monitor cannot tell them apart.
// Thrown at once, not after the timeout; the client makes its socket anew for
// the next call. The request may or may not have run. The Python client's
// ConnectionLost (there an Unreachable, which the C++ client has no equivalent of).
class ConnectionLost : public ClientError {
public:
    using ClientError::ClientError;
};

// The daemon refused the connection at its handshake (its ZAP handler;
// ZMQ_EVENT_HANDSHAKE_FAILED_AUTH): its access policy does not admit this client
// (its user, group, host or CURVE key), or this peer (a local user, a remote
// host) holds more than bus.max_connections connections to that socket. Thrown
// at once, not after the timeout; nothing was sent. The daemon's log says why
// (peer_refused), and status counts it (security.sockets.<socket>.connections_refused).
// The next call (an EventSubscriber's next receive) connects anew. status() is
// the ZAP status code (400: refused;
// 500: the daemon's handler failed). The Python client's ConnectionRefused.
class ConnectionRefused : public ClientError {
public:
    ConnectionRefused(const std::string& what, int status) : ClientError(what), status_(status) {}
    int status() const noexcept { return status_; }

private:
    int status_;
};

// A reply or event that breaks the wire contract (a bug on one side).
class MalformedReply : public ClientError {
public:
    using ClientError::ClientError;
};

// An ipc:// endpoint in a directory another user could write: not connected to.
class UnsafeEndpoint : public ClientError {
public:
    using ClientError::ClientError;
};

}  // namespace inferd
