// Where the daemon's sockets are by default, resolved as clients/inferd_wire/endpoints.py does.
#pragma once

#include <cstddef>
#include <string>

namespace inferd {

// What a client needs for a tcp:// endpoint of a daemon with security.curve:
// the daemon's public key (`inferd keys show`) and this client's keypair, each
// 40 Z85 characters (clients/inferd_wire/curve.py's ClientCurve).
struct ClientCurve {
    std::string server_public_key;
    std::string public_key;
    std::string secret_key;

    // `server_key`: the daemon's public key itself, or a file holding it (a
    // public certificate or the bare key); `certificate`: this client's secret
    // certificate (ZeroMQ's format, as `inferd keys client NAME` writes it),
    // which only its owner may read. Throws ClientError naming what is wrong.
    static ClientCurve from_files(const std::string& server_key, const std::string& certificate);
};

struct Endpoints {
    std::string infer;
    std::string control;
    std::string events;
};

// $INFERD_RUNTIME_DIR, systemd's $RUNTIME_DIRECTORY (first entry),
// $XDG_RUNTIME_DIR/inferd, else $TMPDIR (or /tmp)/inferd-<uid>.
std::string default_runtime_dir();
Endpoints default_endpoints();
Endpoints endpoints_in(const std::string& runtime_dir);
// The registration socket: next to an ipc:// infer socket, else in the runtime dir.
std::string shm_socket_path(const std::string& infer_endpoint);
// A Unix socket path is limited to 107 bytes (sun_path); ipc:// adds 6.
inline constexpr std::size_t kMaxIpcPathBytes = 107;

// `endpoint` unchanged when a client may connect to it; UnsafeEndpoint when it is
// an ipc:// socket in a directory another user could have replaced it in,
// ClientError when its path is longer than a socket address holds or when its
// directory could not be checked (EMFILE...: named with its errno, not unsafe).
std::string check_client_endpoint(const std::string& endpoint);

}  // namespace inferd
