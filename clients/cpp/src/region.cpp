#include "inferd/region.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <variant>

#include "decode.hpp"
#include "inferd/endpoints.hpp"
#include "inferd/errors.hpp"
#include "region_channel.hpp"

namespace inferd {
namespace {

std::string system_error(const std::string& what) { return what + ": " + std::strerror(errno); }

std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

}  // namespace

SharedRegion::SharedRegion(std::size_t nbytes, std::optional<std::string> label)
    : label_(std::move(label)) {
    if (nbytes == 0) throw ClientError("a region needs a positive size");
    auto page = page_size();
    size_ = (nbytes + page - 1) / page * page;
    std::string name = "inferd-" + label_.value_or("region");
    fd_ = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd_ < 0) throw ClientError(system_error("memfd_create"));
    // Sealed against shrinking (what the daemon requires: it can then never fault
    // on the memory), growing, and further sealing.
    if (ftruncate(fd_, static_cast<off_t>(size_)) != 0 ||
        fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        auto message = system_error("sealing the region");
        release();
        throw ClientError(message);
    }
    map();
}

namespace {

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1, include/uapi/linux/fcntl.h
#endif

std::string size_problem(off_t size) {
    auto page = page_size();
    if (size > 0 && static_cast<std::size_t>(size) % page == 0) return {};
    return "the memfd holds " + std::to_string(size) +
           " bytes; a region must be a positive multiple of the page size (" +
           std::to_string(page) + ")";
}

// Why `fd` cannot be adopted, empty once it is sealed against shrinking and its size
// is in `size`. Seals belong to the memfd, not to this descriptor, and cannot be
// taken back: every check that can refuse it comes first, so a refused memfd is
// left to its maker as it came.
std::string seal_for_adoption(int fd, std::size_t& size) {
    if (fd < 0) return "descriptor " + std::to_string(fd) + " cannot be a region: it is not a descriptor";
    int seals = fcntl(fd, F_GET_SEALS);
    int flags = seals < 0 ? -1 : fcntl(fd, F_GETFL);
    struct stat info {};
    if (seals < 0 || flags < 0 || fstat(fd, &info) != 0) {
        return "descriptor " + std::to_string(fd) + " cannot be a region (" +
               std::strerror(errno) + "): it must be a memfd";
    }
    if ((flags & O_ACCMODE) != O_RDWR) {
        return "descriptor " + std::to_string(fd) +
               " is not open read-write: outputs are written into regions";
    }
    if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
        return "the memfd is sealed against writing (seals " + std::to_string(seals) +
               "): outputs are written into regions";
    }
    if (auto problem = size_problem(info.st_size); !problem.empty()) return problem;
    if (!(seals & F_SEAL_SHRINK)) {
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
            return std::string("the memfd cannot be sealed against shrinking (") +
                   std::strerror(errno) +
                   "): it must be created with MFD_ALLOW_SEALING and not sealed with F_SEAL_SEAL";
        }
        // Its maker may have resized it between the check and the seal; now it cannot.
        if (fstat(fd, &info) != 0) return system_error("fstat");
        if (auto problem = size_problem(info.st_size); !problem.empty()) return problem;
    }
    size = static_cast<std::size_t>(info.st_size);
    return {};
}

}  // namespace

SharedRegion SharedRegion::adopt(int fd, std::optional<std::string> label) {
    SharedRegion region;
    region.fd_ = fd;  // owned from here: closed by release() on every refusal
    region.label_ = std::move(label);
    if (auto problem = seal_for_adoption(fd, region.size_); !problem.empty()) {
        region.release();
        throw ClientError(problem);
    }
    region.map();
    return region;
}

void SharedRegion::map() {
    base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (base_ == MAP_FAILED) {
        base_ = nullptr;
        auto message = system_error("the memfd cannot be mapped read-write: mmap");
        release();
        throw ClientError(message);
    }
    // Transparent huge pages where the kernel's shmem policy allows them (as
    // inferd_wire.regions.advise_huge_pages): a big tensor's copies then miss
    // the TLB far less. Advice only: a kernel without THP keeps 4 KiB pages.
    (void)madvise(base_, size_, MADV_HUGEPAGE);
}

SharedRegion::~SharedRegion() { release(); }

SharedRegion::SharedRegion(SharedRegion&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      base_(std::exchange(other.base_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      used_(std::exchange(other.used_, 0)),
      label_(std::move(other.label_)) {}

SharedRegion& SharedRegion::operator=(SharedRegion&& other) noexcept {
    if (this != &other) {
        release();
        fd_ = std::exchange(other.fd_, -1);
        base_ = std::exchange(other.base_, nullptr);
        size_ = std::exchange(other.size_, 0);
        used_ = std::exchange(other.used_, 0);
        label_ = std::move(other.label_);
    }
    return *this;
}

void SharedRegion::release() noexcept {
    if (base_ != nullptr) munmap(base_, size_);
    if (fd_ >= 0) close(fd_);
    base_ = nullptr;
    fd_ = -1;
}

MutableTensorView SharedRegion::allocate(DType dtype, const Shape& shape) {
    if (base_ == nullptr) throw ClientError("the shared region is closed");
    auto nbytes = tensor_bytes(dtype, shape);
    auto offset = (used_ + wire::kRegionAlignment - 1) / wire::kRegionAlignment * wire::kRegionAlignment;
    if (offset + nbytes > size_) {
        throw ClientError("the region has " + std::to_string(size_ - std::min(offset, size_)) +
                          " bytes left; the tensor needs " + std::to_string(nbytes));
    }
    used_ = offset + nbytes;
    return MutableTensorView{dtype, shape, static_cast<char*>(base_) + offset, nbytes};
}

std::optional<std::size_t> SharedRegion::locate(const void* data, std::size_t nbytes) const {
    if (base_ == nullptr || data == nullptr) return std::nullopt;
    auto start = reinterpret_cast<std::uintptr_t>(data);
    auto base = reinterpret_cast<std::uintptr_t>(base_);
    if (start < base || start - base + nbytes > size_) return std::nullopt;
    auto offset = static_cast<std::size_t>(start - base);
    if (offset % wire::kRegionAlignment) return std::nullopt;
    return offset;
}

RegionChannel::RegionChannel(const std::string& path, std::chrono::milliseconds timeout,
                             int reply_spin_us)
    : path_(path), timeout_(timeout), spin_(reply_spin_us) {
    check_client_endpoint("ipc://" + path);  // the same trust rule as for the ipc sockets
    fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw ClientError(system_error("socket"));
    timeval wait{};
    wait.tv_sec = static_cast<time_t>(timeout.count() / 1000);
    wait.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &wait, sizeof wait);
    sockaddr_un address{};  // check_client_endpoint refused a path sun_path cannot hold
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
        auto message = system_error("cannot connect to the shm socket " + path);
        close(fd_);
        throw ClientError(message);
    }
}

RegionChannel::~RegionChannel() {
    if (fd_ >= 0) close(fd_);
}

std::string RegionChannel::register_region(const SharedRegion& region) {
    wire::ControlArguments arguments;
    if (region.label()) arguments.emplace_back("label", *region.label());
    auto result = call("register", arguments, region.fd());
    auto handle = detail::unpack(result.data(), result.size(), wire::kMaxShmMessageBytes);
    detail::Fields fields(handle.get(), "register result");
    return fields.string("region");
}

void RegionChannel::unregister_region(const std::string& region_id) {
    call("unregister", {{"region", region_id}}, -1);
}

// {v, op, ...arguments, id} as the control requests (the Python client sends
// {v, id, op, ...}; the daemon reads keys, not their order).
std::string RegionChannel::call(const std::string& op, const wire::ControlArguments& arguments,
                                int fd) {
    auto request_id = next_id_++;
    auto give_up_at = std::chrono::steady_clock::now() + timeout_;
    if (!send_message(wire::encode_control_request(request_id, op, arguments), fd)) {
        throw Timeout("the daemon does not read the shm socket " + path_);
    }
    auto reply = await(request_id, give_up_at);
    if (!reply) throw Timeout("no reply from " + path_);
    auto decoded = wire::decode_control_reply(reply->data(), reply->size());
    if (!decoded.ok) throw RemoteError(decoded.error->code, decoded.error->message);
    return decoded.result_msgpack;
}

std::string RegionChannel::request(const std::string& model,
                                   const std::function<std::string(std::uint64_t)>& encode,
                                   const std::function<std::uint64_t()>& next_id,
                                   const std::function<void(std::uint64_t, int)>& on_attempt,
                                   std::chrono::milliseconds timeout, int retries) {
    auto& arrivals = arrivals_[model];
    for (int attempt = 0; attempt <= retries; ++attempt) {
        auto request_id = next_id();
        if (on_attempt) on_attempt(request_id, attempt);
        auto give_up_at = std::chrono::steady_clock::now() + timeout;
        if (!send_message(encode(request_id), -1)) continue;
        auto sent = std::chrono::steady_clock::now();
        bool ready = spin_.wait(fd_, arrivals, sent, give_up_at);
        if (auto reply = await(request_id, give_up_at, ready)) {
            arrivals.observed(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - sent)
                                  .count(),
                              spin_.width_ns());
            return *reply;
        }
    }
    throw Timeout("no reply from " + path_ + " within " + std::to_string(timeout.count()) +
                  " ms after " + std::to_string(retries + 1) + " attempt(s)");
}

bool RegionChannel::send_message(const std::string& message, int fd) {
    iovec part{const_cast<char*>(message.data()), message.size()};
    msghdr header{};
    header.msg_iov = &part;
    header.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
        header.msg_control = control;
        header.msg_controllen = sizeof control;
        auto* ancillary = CMSG_FIRSTHDR(&header);
        ancillary->cmsg_level = SOL_SOCKET;
        ancillary->cmsg_type = SCM_RIGHTS;
        ancillary->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(ancillary), &fd, sizeof(int));
    }
    // SO_SNDTIMEO bounds the send: a seqpacket message goes whole or not at all.
    if (sendmsg(fd_, &header, MSG_NOSIGNAL) >= 0) return true;
    // A connection refused at connect (shm.max_connections) has its refusal
    // queued for us: a send that failed otherwise still reads the reply.
    return errno != EAGAIN && errno != EWOULDBLOCK;
}

std::optional<std::string> RegionChannel::await(std::uint64_t request_id,
                                                std::chrono::steady_clock::time_point give_up_at,
                                                bool ready_now) {
    while (true) {
        if (!ready_now) {
            auto left = std::chrono::ceil<std::chrono::milliseconds>(
                give_up_at - std::chrono::steady_clock::now());
            if (left.count() <= 0) return std::nullopt;
            pollfd readable{fd_, POLLIN, 0};
            auto ready = poll(&readable, 1, static_cast<int>(left.count()));
            if (ready < 0 && errno == EINTR) continue;
            if (ready < 0) throw ClientError(system_error("the shm socket " + path_ + " failed"));
            if (ready == 0) return std::nullopt;
        }
        ready_now = false;
        std::string reply(wire::kMaxShmMessageBytes, '\0');
        auto received = recv(fd_, reply.data(), reply.size(), MSG_DONTWAIT);
        if (received < 0 && errno == ECONNRESET) {
            // Reported once when the daemon closed the connection with our message
            // unread; what it sent before closing is still there.
            received = recv(fd_, reply.data(), reply.size(), MSG_DONTWAIT);
            if (received < 0) received = 0;
        }
        if (received < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (received < 0) throw ClientError(system_error("the shm socket " + path_ + " failed"));
        if (received == 0) throw ClientError("the daemon closed the shm socket " + path_);
        reply.resize(static_cast<std::size_t>(received));
        auto id = wire::decode_reply_id(reply.data(), reply.size());
        // A null id: refused before its id could be read (or at connect).
        if (id == wire::RequestId{request_id} || std::holds_alternative<std::monostate>(id)) {
            return reply;
        }
        ++discarded_;
    }
}

}  // namespace inferd
