// Tensor views: what the client sends and receives, without owning or copying it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace inferd {

// The dtypes the wire allows (protocol.ALLOWED_DTYPES); bytes are always little-endian.
enum class DType { Bool, Int8, UInt8, Int16, UInt16, Int32, Int64, Float16, Float32, Float64 };

// The numpy name the wire uses ("float32", ...).
std::string_view dtype_name(DType dtype);
// The dtype of a wire name; throws MalformedReply for a name outside the allow-list.
DType parse_dtype(std::string_view name);
std::size_t itemsize(DType dtype);

using Shape = std::vector<std::int64_t>;

// prod(shape) * itemsize(dtype): the bytes a C-contiguous tensor of that shape holds
// (ClientError for a negative dimension, std::invalid_argument past 2^64 bytes).
std::size_t tensor_bytes(DType dtype, const Shape& shape);

// A C-contiguous little-endian tensor in memory someone else owns (the caller's
// buffer, a shared region, or a received frame). Copying a view copies the
// pointer, never the bytes.
struct TensorView {
    DType dtype = DType::Float32;
    Shape shape;
    const void* data = nullptr;
    std::size_t nbytes = 0;

    template <typename T>
    const T* as() const { return static_cast<const T*>(data); }
};

// A tensor the daemon writes into: an output buffer the caller owns.
struct MutableTensorView {
    DType dtype = DType::Float32;
    Shape shape;
    void* data = nullptr;
    std::size_t nbytes = 0;

    template <typename T>
    T* as() const { return static_cast<T*>(data); }
};

// A view of `count` elements of T at `data`, shaped `shape` (nbytes checked).
TensorView view(DType dtype, Shape shape, const void* data, std::size_t nbytes);
MutableTensorView mutable_view(DType dtype, Shape shape, void* data, std::size_t nbytes);

struct NamedTensor {
    std::string name;
    TensorView tensor;
};

struct NamedOutputBuffer {
    std::string name;
    MutableTensorView buffer;
};

}  // namespace inferd
