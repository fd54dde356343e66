// The two paths of skinny_linear_packed (csrc/linear.h) side by side in one process: the fused AVX-512 tiles
// (rows_packed_avx512) and the buffered path (rows_packed_buffered), on random packed weights of SmolLM2-135M's
// shapes, for the x-row counts given. Why a C++ harness: the VMs this was tuned on change speed from one process to
// the next (~1.5x), so two builds compared in alternating processes decide nothing; here the paths alternate pass by
// pass. Both must give the same bits; the program checks it.
//
//   TI=$(.venv/bin/python -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
//   g++ -O3 -fopenmp -std=c++20 -Icsrc -I$TI benchmarks/packed_paths.cpp -o /tmp/packed_paths
//   /tmp/packed_paths q4 1 6 8 17 32 64 128     # 4-bit: 30 layers' q/k/v, o, gate/up, down (Q4_1)
//   /tmp/packed_paths q8 1 6 8 17 32 64 128     # 8-bit: the 49152 x 576 output head (Q8_0)
//
// Prints per row count the best of 7 passes of each path, ms, with 2 threads splitting the output columns as the op
// does (OMP_NUM_THREADS is not read).
#include "linear.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace fastverify::linear;

namespace {

struct Layer {
  int64_t N, K;
  std::vector<uint8_t> q;
  std::vector<float> d, m;
  Packed p;
};

template <bool Fused>
void run(const float* x, const Packed& p, float* y, int64_t M, int64_t N) {
  const int64_t half = (N / 8) * 4;  // two column ranges of whole 4-row blocks
#pragma omp parallel for num_threads(2)
  for (int t = 0; t < 2; ++t) {
    const int64_t n0 = t ? half : 0, n1 = t ? N : half;
    if constexpr (Fused)
      p.bits == 4 ? rows_packed_avx512<4>(x, p, nullptr, y, M, N, n0, n1)
                  : rows_packed_avx512<8>(x, p, nullptr, y, M, N, n0, n1);
    else
      rows_packed_buffered(x, p, nullptr, y, M, N, n0, n1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::string(argv[1]) != "q4" && std::string(argv[1]) != "q8") || !fastverify::cpu_has_avx512()) {
    std::fprintf(stderr, "usage: packed_paths q4|q8 ROWS... (needs an AVX-512 CPU)\n");
    return 2;
  }
  const int bits = std::string(argv[1]) == "q4" ? 4 : 8;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  if (bits == 4)
    for (int l = 0; l < 30; ++l) shapes.insert(shapes.end(), {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}});
  else
    shapes = {{49152, 576}};
  std::mt19937 g(0);
  std::vector<Layer> layers(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    Layer& a = layers[i];
    a.N = shapes[i].first;
    a.K = shapes[i].second;
    a.q.resize(a.N * a.K * bits / 8);
    a.d.resize(a.N * a.K / 32);
    a.m.resize(a.N * a.K / 32);
    for (auto& v : a.q) v = g() & 255;
    for (auto& v : a.d) v = float(g() % 1000) / 65536.0f;  // d * q exact in float32, as pack_blocks requires
    for (auto& v : a.m) v = bits == 4 ? -float(g() % 1000) / 8192.0f : 0.0f;
    a.p = Packed{a.q.data(), a.d.data(), a.m.data(), bits, a.K};
  }
  int64_t max_m = 0, max_n = 0;
  for (int i = 2; i < argc; ++i) max_m = std::max<int64_t>(max_m, std::atoll(argv[i]));
  for (auto& a : layers) max_n = std::max(max_n, a.N);
  std::vector<float> x(max_m * 1536), y0(max_m * max_n), y1(max_m * max_n);
  for (auto& v : x) v = float(int(g() % 2001) - 1000) / 1000.0f;
  std::printf("| x rows | fused ms | buffered ms | same bits |\n| --- | --- | --- | --- |\n");
  for (int i = 2; i < argc; ++i) {
    const int64_t M = std::atoll(argv[i]);
    if (M < 1) continue;
    double best[2] = {1e30, 1e30};
    for (int rep = 0; rep < 7; ++rep)
      for (int path = 0; path < 2; ++path) {
        const auto t0 = std::chrono::steady_clock::now();
        for (auto& a : layers)
          path ? run<false>(x.data(), a.p, y1.data(), M, a.N) : run<true>(x.data(), a.p, y0.data(), M, a.N);
        best[path] = std::min(best[path], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    bool same = true;
    for (auto& a : layers) {
      run<true>(x.data(), a.p, y0.data(), M, a.N);
      run<false>(x.data(), a.p, y1.data(), M, a.N);
      same = same && std::memcmp(y0.data(), y1.data(), sizeof(float) * M * a.N) == 0;
    }
    std::printf("| %lld | %.2f | %.2f | %s |\n", static_cast<long long>(M), 1e3 * best[0], 1e3 * best[1],
                same ? "yes" : "NO");
  }
  return 0;
}
