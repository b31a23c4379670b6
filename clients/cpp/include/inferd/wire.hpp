// The wire codec: request headers to msgpack bytes and reply headers and event
// payloads from them, mirroring clients/inferd_wire/protocol.py. Encoding is
// byte-for-byte what the Python client sends (same key order, smallest msgpack
// encodings), which schemas/conformance/ checks. Decoding is as strict as the
// JSON Schemas in schemas/bus/: anything else is MalformedReply.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "inferd/errors.hpp"
#include "inferd/tensor.hpp"

namespace inferd::wire {

constexpr int kProtocolVersion = 1;
constexpr std::size_t kMaxHeaderBytes = 64 * 1024;
// The longest request header any daemon reads (bus.max_header_bytes' ceiling;
// inferd_wire.protocol.MAX_HEADER_FRAME_BYTES): the daemon refuses a longer one
// with id null, which no call can tell for its own, so the client refuses it
// before sending (ClientError) rather than wait out the timeout.
constexpr std::size_t kMaxHeaderFrameBytes = 256 * 1024;
constexpr std::size_t kMaxIdChars = 128;
constexpr std::size_t kMaxDimensions = 16;
constexpr std::size_t kRegionAlignment = 256;
constexpr std::size_t kMaxShmMessageBytes = 16384;

// An echoed request id: null (the daemon could not read one), an integer or a string.
using RequestId = std::variant<std::monostate, std::uint64_t, std::string>;

struct RegionRef {
    std::string region;  // 32 lowercase hex digits
    std::uint64_t offset = 0;
    std::uint64_t nbytes = 0;
};

struct TensorDescriptor {
    std::string name;
    DType dtype = DType::Float32;
    Shape shape;
    std::optional<RegionRef> region;  // set: the tensor lives in a region, no frame
};

struct InferRequest {
    std::uint64_t id = 0;
    std::string model;
    std::vector<TensorDescriptor> inputs;
    std::vector<TensorDescriptor> outputs;  // outputs placed in regions only
    std::optional<std::uint32_t> deadline_ms;
    // The client's bound on a reply frame (ClientOptions::max_reply_frame_bytes),
    // told to the daemon, which answers RESOURCE_EXHAUSTED rather than send more.
    std::optional<std::int64_t> max_reply_frame_bytes;
};

// An argument of a control op: a string, an integer or a boolean.
using ControlValue = std::variant<std::string, std::int64_t, bool>;
using ControlArguments = std::vector<std::pair<std::string, ControlValue>>;

std::string encode_infer_request(const InferRequest& request);
std::string encode_describe_request(std::uint64_t id);
std::string encode_control_request(std::uint64_t id, const std::string& op,
                                   const ControlArguments& arguments);

struct ErrorInfo {
    ErrorCode code = ErrorCode::Internal;
    std::string message;
};

enum class ThermalSummary { Nominal, Throttling, Unknown };

// The header of a reply to infer (infer_reply.json): an error, or the metadata
// and output descriptors of a result.
struct InferReply {
    RequestId id;
    bool ok = false;
    std::optional<ErrorInfo> error;  // set when !ok
    std::string model;
    std::string runtime;  // "tensorrt" or "onnx_trt_ep"
    bool fallback = false;
    std::uint64_t latency_us = 0;
    std::uint64_t queue_us = 0;
    bool late = false;  // finished after the request's deadline_ms
    ThermalSummary thermal = ThermalSummary::Unknown;
    std::vector<TensorDescriptor> outputs;
};

// The id of any reply header (for correlation), or MalformedReply.
RequestId decode_reply_id(const void* data, std::size_t size);
InferReply decode_infer_reply(const void* data, std::size_t size);

// A received frame: bytes ZeroMQ owns.
struct FrameBytes {
    const void* data;
    std::size_t size;
};

// The outputs of an ok reply, as InferenceClient::infer returns them: an output
// the request placed in a region (`placed`) is the caller's buffer of `into`; any
// other is a view of its frame, or, when `into` has a buffer for it, that buffer
// filled from the frame. MalformedReply when frames and descriptors disagree, an
// output was written into a region the request did not name, or with another
// dtype or shape than it was placed with; ClientError when a buffer cannot take
// its output (dtype, shape, nbytes) or names no output of the reply. Every
// output is checked before any buffer is written.
std::vector<NamedTensor> decode_outputs(const InferReply& reply, const std::vector<FrameBytes>& frames,
                                        const std::vector<TensorDescriptor>& placed,
                                        const std::vector<NamedOutputBuffer>& into);

// A control reply (and describe): the error, or `result` as a msgpack map kept
// encoded for the op's own decoder.
struct ControlReply {
    RequestId id;
    bool ok = false;
    std::optional<ErrorInfo> error;
    std::string result_msgpack;
};
ControlReply decode_control_reply(const void* data, std::size_t size);

std::string_view thermal_summary_name(ThermalSummary thermal);

// A msgpack value as JSON text (maps keep their order), for logs and for results
// without a struct of their own (status). Throws MalformedReply on bad msgpack.
std::string msgpack_to_json(const void* data, std::size_t size);

}  // namespace inferd::wire
