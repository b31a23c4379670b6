// Shared-memory regions: a sealed memfd mapped read-write, whose bytes the daemon
// reads inputs from and writes outputs into (docs/PROTOCOL.md, "Shared-memory tensors").
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "inferd/tensor.hpp"

namespace inferd {

class InferenceClient;

namespace detail {
// Where a region's memory is mapped, shared by the region and the clients that
// registered it: a move hands it to the new region whole, and the region's end
// (destruction, or being assigned over) empties it before unmapping, so a client
// never finds bytes in memory that is no longer the region's. A client registers
// it again from its descriptor and label when the daemon restarted.
struct RegionMapping {
    const void* base = nullptr;  // null: the region is gone
    std::size_t size = 0;
    int fd = -1;  // the region's memfd, while it lives
    std::optional<std::string> label;
    // The offset of [data, data + nbytes) when it is an aligned block of the mapping.
    std::optional<std::size_t> locate(const void* data, std::size_t nbytes) const;
};
}  // namespace detail

// Owns the memfd and its mapping; moves, never copies. Tensors allocated in it
// start at 256-byte aligned offsets (what the daemon requires of a region tensor).
class SharedRegion {
public:
    // At least nbytes, rounded up to the page size; sealed against shrinking,
    // growing and further seals.
    explicit SharedRegion(std::size_t nbytes, std::optional<std::string> label = std::nullopt);
    // A region over a memfd made elsewhere (a capture service's frame buffer,
    // received with SCM_RIGHTS), which the region owns from now on: a memfd open
    // read-write, not sealed against writing, a positive multiple of the page
    // size, and sealed against shrinking or still sealable; sealed against
    // shrinking, growing and further seals here unless it already is against
    // shrinking. ClientError with the reason otherwise, fd closed, and no seal
    // added: a refused memfd is left to its maker as it came.
    static SharedRegion adopt(int fd, std::optional<std::string> label = std::nullopt);
    ~SharedRegion();
    SharedRegion(SharedRegion&& other) noexcept;
    SharedRegion& operator=(SharedRegion&& other) noexcept;
    SharedRegion(const SharedRegion&) = delete;
    SharedRegion& operator=(const SharedRegion&) = delete;

    // A new tensor in the region (its bytes are whatever was there).
    MutableTensorView allocate(DType dtype, const Shape& shape);
    // Allocate from the start again (views handed out before alias new ones).
    void reset() { used_ = 0; }

    // The offset of [data, data + nbytes) when it is an aligned block of this region.
    std::optional<std::size_t> locate(const void* data, std::size_t nbytes) const;

    std::size_t size() const { return size_; }
    int fd() const { return fd_; }
    void* data() const { return base_; }
    const std::optional<std::string>& label() const { return label_; }

private:
    SharedRegion() = default;
    // Map fd_ (size_ bytes) read-write, shared, with huge pages advised; releases
    // and throws on failure.
    void map();
    void release() noexcept;

    int fd_ = -1;
    void* base_ = nullptr;
    std::size_t size_ = 0;
    std::size_t used_ = 0;
    std::optional<std::string> label_;
    std::shared_ptr<detail::RegionMapping> mapping_;  // what a registering client keeps
    friend class InferenceClient;
};

}  // namespace inferd
