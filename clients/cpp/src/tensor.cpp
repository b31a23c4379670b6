#include "inferd/tensor.hpp"

#include <array>
#include <stdexcept>
#include <string>
#include <utility>

#include "inferd/errors.hpp"

namespace inferd {
namespace {

struct DTypeInfo {
    DType dtype;
    std::string_view name;
    std::size_t itemsize;
};

constexpr std::array<DTypeInfo, 10> kDTypes{{
    {DType::Bool, "bool", 1},
    {DType::Int8, "int8", 1},
    {DType::UInt8, "uint8", 1},
    {DType::Int16, "int16", 2},
    {DType::UInt16, "uint16", 2},
    {DType::Int32, "int32", 4},
    {DType::Int64, "int64", 8},
    {DType::Float16, "float16", 2},
    {DType::Float32, "float32", 4},
    {DType::Float64, "float64", 8},
}};

const DTypeInfo& info(DType dtype) {
    for (const auto& entry : kDTypes) {
        if (entry.dtype == dtype) return entry;
    }
    throw ClientError("unknown dtype value " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::size_t itemsize(DType dtype) { return info(dtype).itemsize; }

DType parse_dtype(std::string_view name) {
    for (const auto& entry : kDTypes) {
        if (entry.name == name) return entry.dtype;
    }
    throw MalformedReply("dtype '" + std::string(name) + "' is not allowed on the wire");
}

std::size_t tensor_bytes(DType dtype, const Shape& shape) {
    bool empty = false;
    for (auto dimension : shape) {
        if (dimension < 0) throw ClientError("a tensor dimension cannot be negative");
        empty = empty || dimension == 0;
    }
    if (empty) return 0;
    // Checked: a wrapped size would pass every bounds check after it (a region's
    // allocation, a view's size, a frame's) and alias memory it does not own.
    std::size_t bytes = itemsize(dtype);
    for (auto dimension : shape) {
        if (__builtin_mul_overflow(bytes, static_cast<std::size_t>(dimension), &bytes)) {
            throw std::invalid_argument("a " + std::string(dtype_name(dtype)) +
                                        " tensor of that shape would hold more than 2^64 bytes");
        }
    }
    return bytes;
}

namespace {
void check_size(DType dtype, const Shape& shape, std::size_t nbytes) {
    auto expected = tensor_bytes(dtype, shape);
    if (expected != nbytes) {
        throw ClientError("a tensor of that shape and dtype holds " + std::to_string(expected) +
                          " bytes, not " + std::to_string(nbytes));
    }
}
}  // namespace

TensorView view(DType dtype, Shape shape, const void* data, std::size_t nbytes) {
    check_size(dtype, shape, nbytes);
    return TensorView{dtype, std::move(shape), data, nbytes};
}

MutableTensorView mutable_view(DType dtype, Shape shape, void* data, std::size_t nbytes) {
    check_size(dtype, shape, nbytes);
    return MutableTensorView{dtype, std::move(shape), data, nbytes};
}

std::string_view error_code_name(ErrorCode code) {
    switch (code) {
        case ErrorCode::InvalidArgument: return "INVALID_ARGUMENT";
        case ErrorCode::NotFound: return "NOT_FOUND";
        case ErrorCode::Unavailable: return "UNAVAILABLE";
        case ErrorCode::DeadlineExceeded: return "DEADLINE_EXCEEDED";
        case ErrorCode::ResourceExhausted: return "RESOURCE_EXHAUSTED";
        case ErrorCode::PermissionDenied: return "PERMISSION_DENIED";
        case ErrorCode::FailedPrecondition: return "FAILED_PRECONDITION";
        case ErrorCode::Cancelled: return "CANCELLED";
        case ErrorCode::Internal: return "INTERNAL";
    }
    return "INTERNAL";
}

bool parse_error_code(std::string_view name, ErrorCode& code) {
    for (auto candidate :
         {ErrorCode::InvalidArgument, ErrorCode::NotFound, ErrorCode::Unavailable,
          ErrorCode::DeadlineExceeded, ErrorCode::ResourceExhausted, ErrorCode::PermissionDenied,
          ErrorCode::FailedPrecondition, ErrorCode::Cancelled, ErrorCode::Internal}) {
        if (error_code_name(candidate) == name) {
            code = candidate;
            return true;
        }
    }
    return false;
}

RemoteError::RemoteError(ErrorCode code, std::string message)
    : ClientError(std::string(error_code_name(code)) + ": " + message),
      code_(code),
      message_(std::move(message)) {}

}  // namespace inferd
