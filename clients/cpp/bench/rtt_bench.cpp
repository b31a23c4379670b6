// The C++ side of bench/rtt_cpp.py: one InferenceClient, timed the way the
// Python bench times its client (a monotonic clock around each infer call).
//
//   inferd_rtt_bench ENDPOINT MODEL INPUT_NAME DIM... [-- OUTPUT_NAME DIM...]
//   then on stdin: "block N" -> N calls, one line of N round trips in
//   nanoseconds; "quit"
//
// With `-- OUTPUT_NAME DIM...` the input and that output live in one shared
// region (the output written in place), so the requests go on shm.sock.
#include <inferd/inferd.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) try {
    if (argc < 5) {
        std::cerr << "usage: inferd_rtt_bench ENDPOINT MODEL INPUT_NAME DIM... [-- OUTPUT_NAME DIM...]\n";
        return 2;
    }
    inferd::ClientOptions options;
    options.endpoint = argv[1];
    options.timeout = std::chrono::seconds(10);
    inferd::InferenceClient client(options);
    const std::string model = argv[2];
    std::vector<std::string> args(argv + 4, argv + argc);
    auto split = std::find(args.begin(), args.end(), "--");
    inferd::Shape shape;
    for (auto it = args.begin(); it != split; ++it) shape.push_back(std::stoll(*it));
    const auto input_bytes = inferd::tensor_bytes(inferd::DType::Float32, shape);

    // The Python bench's input: ones.
    std::vector<float> input(input_bytes / sizeof(float), 1.0f);
    std::vector<inferd::NamedTensor> inputs{
        {argv[3], inferd::view(inferd::DType::Float32, shape, input.data(), input_bytes)}};
    inferd::InferOptions infer;
    if (split != args.end()) {
        if (std::next(split) == args.end()) throw std::invalid_argument("-- needs OUTPUT_NAME DIM...");
        const std::string output_name = *std::next(split);
        inferd::Shape output_shape;
        for (auto it = std::next(split, 2); it != args.end(); ++it) output_shape.push_back(std::stoll(*it));
        const auto output_bytes = inferd::tensor_bytes(inferd::DType::Float32, output_shape);
        auto& region = client.shared_region(input_bytes + output_bytes + 4096, std::string("rtt-bench"));
        auto shared_input = region.allocate(inferd::DType::Float32, shape);
        std::fill_n(shared_input.as<float>(), input_bytes / sizeof(float), 1.0f);
        inputs = {{argv[3], inferd::view(inferd::DType::Float32, shape, shared_input.data, input_bytes)}};
        infer.outputs.push_back({output_name, region.allocate(inferd::DType::Float32, output_shape)});
        client.describe();  // names the model's outputs: the requests go on shm.sock
        client.infer(model, inputs, infer);
        if (client.last_transport() != "shm") throw std::runtime_error("the request did not go on shm.sock");
    }

    std::string command;
    while (std::cin >> command && command == "block") {
        int count = 0;
        std::cin >> count;
        std::vector<long long> samples;
        samples.reserve(static_cast<std::size_t>(count));
        for (int i = 0; i < count; ++i) {
            auto started = std::chrono::steady_clock::now();
            auto result = client.infer(model, inputs, infer);
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
