#include "inferd/endpoints.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "inferd/errors.hpp"

namespace inferd {
namespace {

const char* environment(const char* name) {
    const char* value = std::getenv(name);
    return (value != nullptr && *value != '\0') ? value : nullptr;
}

std::string parent_of(const std::string& path) {
    auto slash = path.find_last_of('/');
    if (slash == std::string::npos) return ".";
    if (slash == 0) return "/";
    return path.substr(0, slash);
}

std::string fallback_runtime_dir() {
    // Python's tempfile.gettempdir(): $TMPDIR, else /tmp.
    const char* tmp = environment("TMPDIR");
    std::string base = tmp != nullptr ? tmp : "/tmp";
    while (base.size() > 1 && base.back() == '/') base.pop_back();
    return base + "/inferd-" + std::to_string(getuid());
}

// Why `path` is not a directory to trust (endpoints.unsafe_directory_reason), or nullopt.
std::optional<std::string> unsafe_directory_reason(const std::string& path,
                                                   std::optional<uid_t> owner) {
    int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return std::string("does not exist");
        if (errno == ELOOP || errno == ENOTDIR) return std::string("is not a directory or a symbolic link");
        return std::string("cannot be opened");
    }
    struct stat info {};
    int rc = fstat(fd, &info);
    close(fd);
    if (rc != 0) return std::string("cannot be examined");
    if (owner && info.st_uid != *owner) {
        return "is owned by uid " + std::to_string(info.st_uid) + ", not by uid " +
               std::to_string(*owner);
    }
    if (info.st_mode & (S_IWGRP | S_IWOTH)) {
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", info.st_mode & 07777);
        return std::string("is writable by its group or others (mode ") + mode + ")";
    }
    return std::nullopt;
}

}  // namespace

std::string default_runtime_dir() {
    for (const char* variable : {"INFERD_RUNTIME_DIR", "RUNTIME_DIRECTORY"}) {
        if (const char* value = environment(variable)) {
            std::string text = value;
            return text.substr(0, text.find(':'));
        }
    }
    if (const char* xdg = environment("XDG_RUNTIME_DIR")) return std::string(xdg) + "/inferd";
    return fallback_runtime_dir();
}

Endpoints endpoints_in(const std::string& runtime_dir) {
    return Endpoints{"ipc://" + runtime_dir + "/infer.sock", "ipc://" + runtime_dir + "/control.sock",
                     "ipc://" + runtime_dir + "/events.sock"};
}

Endpoints default_endpoints() { return endpoints_in(default_runtime_dir()); }

std::string shm_socket_path(const std::string& infer_endpoint) {
    const std::string scheme = "ipc://";
    if (infer_endpoint.rfind(scheme, 0) == 0) {
        return parent_of(infer_endpoint.substr(scheme.size())) + "/shm.sock";
    }
    return default_runtime_dir() + "/shm.sock";
}

std::string check_client_endpoint(const std::string& endpoint) {
    const std::string scheme = "ipc://";
    if (endpoint.rfind(scheme, 0) != 0) return endpoint;
    auto directory = parent_of(endpoint.substr(scheme.size()));
    std::optional<uid_t> owner;
    if (directory == fallback_runtime_dir()) owner = getuid();
    auto reason = unsafe_directory_reason(directory, owner);
    if (reason && *reason != "does not exist") {
        throw UnsafeEndpoint("not connecting to " + endpoint + ": its directory " + directory +
                             " " + *reason +
                             ", so another user could have put their own socket there; use a "
                             "directory only the daemon's user can write (INFERD_RUNTIME_DIR, or "
                             "the daemon's runtime_dir)");
    }
    return endpoint;
}

}  // namespace inferd
