// The registration connection to the daemon's shm.sock (internal).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "inferd/client.hpp"
#include "inferd/region.hpp"
#include "inferd/wire.hpp"

namespace inferd {

// The daemon keeps a region mapped while the connection that registered it is
// open: closing this releases every region it registered.
class RegionChannel {
public:
    RegionChannel(const std::string& path, std::chrono::milliseconds timeout);
    ~RegionChannel();
    RegionChannel(const RegionChannel&) = delete;
    RegionChannel& operator=(const RegionChannel&) = delete;

    std::string register_region(const SharedRegion& region);
    void unregister_region(const std::string& region_id);

private:
    std::string call(const std::string& op, const wire::ControlArguments& arguments, int fd);
    std::string path_;
    int fd_ = -1;
    std::uint64_t next_id_ = 1;
};

}  // namespace inferd
