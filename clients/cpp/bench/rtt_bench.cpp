// The C++ side of bench/rtt_cpp.py: one InferenceClient, timed the way the
// Python bench times its client (a monotonic clock around each infer call).
//
//   inferd_rtt_bench ENDPOINT MODEL INPUT_NAME DIM...   then on stdin:
//   "block N" -> N calls, one line of N round trips in nanoseconds
//   "quit"
#include <inferd/inferd.hpp>

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) try {
    if (argc < 5) {
        std::cerr << "usage: inferd_rtt_bench ENDPOINT MODEL INPUT_NAME DIM...\n";
        return 2;
    }
    inferd::ClientOptions options;
    options.endpoint = argv[1];
    options.timeout = std::chrono::seconds(10);
    inferd::InferenceClient client(options);
    const std::string model = argv[2];
    inferd::Shape shape;
    for (int i = 4; i < argc; ++i) shape.push_back(std::stoll(argv[i]));
    // The Python bench's input: ones.
    std::vector<float> input(inferd::tensor_bytes(inferd::DType::Float32, shape) / sizeof(float), 1.0f);
    const std::vector<inferd::NamedTensor> inputs{
        {argv[3], inferd::view(inferd::DType::Float32, shape, input.data(), input.size() * sizeof(float))}};

    std::string command;
    while (std::cin >> command && command == "block") {
        int count = 0;
        std::cin >> count;
        std::vector<long long> samples;
        samples.reserve(static_cast<std::size_t>(count));
        for (int i = 0; i < count; ++i) {
            auto started = std::chrono::steady_clock::now();
            auto result = client.infer(model, inputs);
            samples.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - started)
                                  .count());
        }
        for (std::size_t i = 0; i < samples.size(); ++i) std::cout << (i ? " " : "") << samples[i];
        std::cout << std::endl;
    }
    return 0;
} catch (const std::exception& error) {
    std::cerr << "inferd_rtt_bench: " << error.what() << "\n";
    return 1;
}
