// safetensors throughput against plain file I/O of the same bytes in the same run:
//  - load with copy vs read() of the whole file into memory (goal >= 0.9 of read's throughput);
//  - load memory-mapped (no copy) vs the same read();
//  - save (atomic, streamed tensor by tensor: temp file, fsync, rename) vs write() + fsync of the
//    same bytes;
//  - torch.save files: difftrain's weights-only reader vs LibTorch's pickle_load on the same bytes.
//  - a safetensors header of N empty tensors (N = 10,000 to 200,000) parsed and validated vs
//    nlohmann's plain parse of the same JSON: a ratio that stays flat as N grows says the reader
//    is linear in the header, as the plain parse is.
// Size: DIFFTRAIN_BENCH_IO_BYTES (default 1 GiB) in one float32 tensor plus a few small ones.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <unistd.h>
#include <difftrain/io/safetensors.hpp>
#include <difftrain/io/torch_file.hpp>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace {
namespace io = difftrain::io;

std::int64_t io_bytes() {
  const char* env = std::getenv("DIFFTRAIN_BENCH_IO_BYTES");
  return env != nullptr ? std::stoll(env) : (std::int64_t{1} << 30);
}

const std::map<std::string, at::Tensor>& payload() {
  static const std::map<std::string, at::Tensor> t = {{"big", at::rand({io_bytes() / 4})},
                                                      {"bias", at::rand({1024})},
                                                      {"scale", at::ones({1}, at::kBFloat16)}};
  return t;
}

std::filesystem::path file() {
  static const std::filesystem::path p = [] {
    auto path = std::filesystem::temp_directory_path() / "difftrain_bench.safetensors";
    io::save_safetensors(path, payload());
    return path;
  }();
  return p;
}

// Reading the file with read() into freshly allocated memory: a loader that hands out new tensors
// has to get new memory too, so both sides pay for it.
void read_all(benchmark::State& state) {
  const auto path = file();
  const auto size = static_cast<std::size_t>(std::filesystem::file_size(path));
  for (auto _ : state) {
    at::Tensor buf = at::empty({static_cast<std::int64_t>(size)}, at::kByte);
    auto* data = static_cast<char*>(buf.data_ptr());
    const int fd = ::open(path.c_str(), O_RDONLY);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::read(fd, data + done, size - done);
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
    benchmark::DoNotOptimize(data);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(size));
}

void load(benchmark::State& state, bool copy) {
  const auto path = file();
  for (auto _ : state) {
    auto f = io::load_safetensors(path, copy);
    benchmark::DoNotOptimize(f.tensors.at("big").data_ptr());
  }
  state.SetBytesProcessed(state.iterations() *
                          static_cast<std::int64_t>(std::filesystem::file_size(path)));
}

void write_raw(benchmark::State& state) {
  const auto bytes = io::safetensors_bytes(payload());
  const auto path = std::filesystem::temp_directory_path() / "difftrain_bench_raw.bin";
  for (auto _ : state) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    ::fsync(fd);
    ::close(fd);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes.size()));
}

void save(benchmark::State& state) {
  const auto path = std::filesystem::temp_directory_path() / "difftrain_bench_save.safetensors";
  for (auto _ : state) io::save_safetensors(path, payload());
  state.SetBytesProcessed(state.iterations() *
                          static_cast<std::int64_t>(std::filesystem::file_size(path)));
}
// A torch.save file of a quarter of the payload, held in memory: the weights-only reader against
// LibTorch's own unpickler on the same bytes (a flat dict, which both can read).
const std::vector<char>& torch_file_bytes() {
  static const std::vector<char> bytes = [] {
    std::map<std::string, at::Tensor> t = {{"big", at::rand({io_bytes() / 16})},
                                           {"bias", at::rand({1024})}};
    return io::torch_save_bytes(io::to_ivalue(t));
  }();
  return bytes;
}

void torch_load_libtorch(benchmark::State& state) {
  const auto& bytes = torch_file_bytes();
  for (auto _ : state) benchmark::DoNotOptimize(torch::jit::pickle_load(bytes));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes.size()));
}

void torch_load_difftrain(benchmark::State& state) {
  const auto& bytes = torch_file_bytes();
  for (auto _ : state) benchmark::DoNotOptimize(io::parse_torch_file(bytes, "bench.pt"));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes.size()));
}
std::string many_entries_header(std::int64_t n) {
  std::string h = "{";
  for (std::int64_t i = 0; i < n; ++i)
    h += (i ? ",\"t" : "\"t") + std::to_string(i) +
         "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  return h + "}";
}

void header_plain_parse(benchmark::State& state) {
  const std::string h = many_entries_header(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(nlohmann::json::parse(h));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(h.size()));
}

void header_difftrain(benchmark::State& state) {
  const std::string h = many_entries_header(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(io::parse_safetensors_header(h.data(), h.size(), 0, "bench"));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(h.size()));
}
}  // namespace

BENCHMARK(header_plain_parse)
    ->Name("safetensors_header_entries/baseline")
    ->Arg(10'000)
    ->Arg(40'000)
    ->Arg(200'000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(header_difftrain)
    ->Name("safetensors_header_entries/difftrain")
    ->Arg(10'000)
    ->Arg(40'000)
    ->Arg(200'000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(torch_load_libtorch)->Name("torch_file_load/baseline")->Iterations(3)->UseRealTime();
BENCHMARK(torch_load_difftrain)->Name("torch_file_load/difftrain")->Iterations(3)->UseRealTime();
BENCHMARK(read_all)->Name("safetensors_load_copy/baseline")->Iterations(3)->UseRealTime();
BENCHMARK_CAPTURE(load, copy, true)
    ->Name("safetensors_load_copy/difftrain")
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(read_all)->Name("safetensors_load_mmap/baseline")->Iterations(3)->UseRealTime();
BENCHMARK_CAPTURE(load, mmap, false)
    ->Name("safetensors_load_mmap/difftrain")
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(write_raw)->Name("safetensors_save/baseline")->Iterations(2)->UseRealTime();
BENCHMARK(save)->Name("safetensors_save/difftrain")->Iterations(2)->UseRealTime();
