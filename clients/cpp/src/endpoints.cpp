#include "inferd/endpoints.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <regex>
#include <sstream>

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

// `path` written one way ("/tmp//a/./b/" is "/tmp/a/b"), so that two ways of
// writing one directory compare equal, as the Python client's pathlib paths do.
std::string lexical(const std::string& path) {
    auto text = std::filesystem::path(path).lexically_normal().string();
    while (text.size() > 1 && text.back() == '/') text.pop_back();
    return text;
}

std::string fallback_runtime_dir() {
    // Python's tempfile.gettempdir(): $TMPDIR, else /tmp (normalised).
    const char* tmp = environment("TMPDIR");
    return lexical(std::string(tmp != nullptr ? tmp : "/tmp") + "/inferd-" + std::to_string(getuid()));
}

// Why `path` is not a directory to trust (endpoints.unsafe_directory_reason), or nullopt.
// `unchecked` is set to the errno when it could not be checked for a reason that
// says nothing about the directory (EMFILE, ENFILE, ENOMEM, EIO...): only a
// symlink or non-directory there, or one this user may not enter, is about it.
std::optional<std::string> unsafe_directory_reason(const std::string& path,
                                                   std::optional<uid_t> owner, int& unchecked) {
    int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return std::string("does not exist");
        if (errno == ELOOP || errno == ENOTDIR) return std::string("is not a directory or a symbolic link");
        if (errno == EACCES || errno == EPERM) return std::string("cannot be opened");
        unchecked = errno;
        return std::nullopt;
    }
    struct stat info {};
    int rc = fstat(fd, &info);
    int fstat_errno = errno;
    close(fd);
    if (rc != 0) {
        unchecked = fstat_errno;
        return std::nullopt;
    }
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

constexpr std::size_t kZ85KeyLength = 40;

bool is_z85_key(const std::string& text) {
    static const std::string alphabet =
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    return text.size() == kZ85KeyLength && text.find_first_not_of(alphabet) == std::string::npos;
}

std::string read_text(const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    if (!file) throw ClientError(path + ": cannot be read");
    return std::string(std::istreambuf_iterator<char>(file), {});
}

std::string trimmed(const std::string& text) {
    auto start = text.find_first_not_of(" \t\r\n");
    auto end = text.find_last_not_of(" \t\r\n");
    return start == std::string::npos ? "" : text.substr(start, end - start + 1);
}

// The public-key and secret-key lines of a ZeroMQ certificate (ZPL).
std::pair<std::string, std::string> certificate_keys(const std::string& text, const std::string& source) {
    static const std::regex line(R"re(^\s*(public|secret)-key\s*=\s*"([^"]*)"\s*$)re");
    std::string public_key, secret_key;
    std::istringstream lines(text);
    std::string current;
    while (std::getline(lines, current)) {
        std::smatch match;
        if (!std::regex_match(current, match, line)) continue;
        if (!is_z85_key(match[2])) {
            throw ClientError(source + ": " + std::string(match[1]) + "-key is not a CURVE key");
        }
        (match[1] == "public" ? public_key : secret_key) = match[2];
    }
    if (public_key.empty()) throw ClientError(source + ": no public-key line; not a CURVE certificate");
    return {public_key, secret_key};
}

}  // namespace

ClientCurve ClientCurve::from_files(const std::string& server_key, const std::string& certificate) {
    ClientCurve curve;
    // A file whenever the path names one (a 40-character path is no key), else the
    // key itself.
    struct stat key_file {};
    if (stat(server_key.c_str(), &key_file) == 0 && S_ISREG(key_file.st_mode)) {
        auto text = read_text(server_key);
        auto bare = trimmed(text);
        curve.server_public_key = is_z85_key(bare) ? bare : certificate_keys(text, server_key).first;
    } else if (is_z85_key(server_key)) {
        curve.server_public_key = server_key;
    } else {
        throw ClientError(server_key + ": neither a file holding the daemon's public key nor the key");
    }
    struct stat info {};
    if (stat(certificate.c_str(), &info) != 0) throw ClientError(certificate + ": cannot be read");
    if (info.st_mode & 077) {
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", info.st_mode & 07777);
        throw ClientError(certificate + ": a secret key others may read (mode " + mode +
                          "); chmod 600 " + certificate);
    }
    auto [public_key, secret_key] = certificate_keys(read_text(certificate), certificate);
    if (secret_key.empty()) {
        throw ClientError(certificate + ": holds no secret-key (a public certificate?)");
    }
    char derived[kZ85KeyLength + 1] = {};
    if (zmq_curve_public(derived, secret_key.c_str()) != 0 || public_key != derived) {
        throw ClientError(certificate + ": its secret-key does not belong to its public-key");
    }
    curve.public_key = public_key;
    curve.secret_key = secret_key;
    return curve;
}

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
    const auto path = endpoint.substr(scheme.size());
    if (path.size() > kMaxIpcPathBytes) {
        throw ClientError("cannot connect to " + endpoint + ": ipc path is " +
                          std::to_string(path.size()) + " bytes; Unix sockets allow " +
                          std::to_string(kMaxIpcPathBytes));
    }
    auto directory = parent_of(path);
    std::optional<uid_t> owner;
    // Compared as paths: "/tmp//inferd-1000" skipped the rule. (The directory
    // examined stays the one written: ".." through a symlink leads elsewhere.)
    if (lexical(directory) == fallback_runtime_dir()) owner = getuid();
    int unchecked = 0;
    auto reason = unsafe_directory_reason(directory, owner, unchecked);
    if (unchecked != 0) {
        // Not UnsafeEndpoint: "another user could have put their own socket there"
        // at the descriptor limit would send an operator hunting for an attacker.
        throw ClientError("not connecting to " + endpoint + ": its directory " + directory +
                          " could not be checked (errno " + std::to_string(unchecked) + ": " +
                          std::strerror(unchecked) +
                          "), a limit or failure of this process or system, not a sign of "
                          "another user's socket");
    }
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
