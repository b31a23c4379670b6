// Where the daemon's sockets are by default, resolved as clients/inferd_wire/endpoints.py does.
#pragma once

#include <string>

namespace inferd {

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
// `endpoint` unchanged when a client may connect to it; UnsafeEndpoint when it is
// an ipc:// socket in a directory another user could have replaced it in.
std::string check_client_endpoint(const std::string& endpoint);

}  // namespace inferd
