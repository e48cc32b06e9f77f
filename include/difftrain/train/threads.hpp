#pragma once
// How many intra-op threads to use on a machine other processes share.
//
// LibTorch's CPU kernels split work over OpenMP threads, one per core by default, and meet at a
// barrier after each parallel region. When other processes keep cores busy, a thread that the
// kernel scheduler parks behind one of them holds every other thread at the next barrier, where
// they spin (GNU OpenMP's default wait policy) until it runs again: a step that takes 70 ms on a
// quiet two-core machine took 5 to 16 times as long with two other busy processes
// (docs/train.md, "A shared machine", has the measurements). Using only the cores nobody else
// is using avoids most of it; OMP_WAIT_POLICY=PASSIVE, which must be set before the program
// starts, avoids the rest.
//
// `cpu_load` measures, over a short window at start-up while this process does nothing, how busy
// the cores this process may run on are; `threads_for` turns that into a thread count.

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace difftrain::train {

/// The cores this process may run on and how many of them other processes keep busy.
struct CpuLoad {
  int cores = 1;                ///< in this process's affinity mask
  double busy_elsewhere = 0.0;  ///< cores' worth of time other processes used in the window
};

namespace threads_detail {
struct Jiffies {
  std::uint64_t busy = 0, total = 0;
};

// Busy and total time of each CPU from /proc/stat ("cpuN user nice system idle iowait irq softirq
// steal ..."); idle and iowait are the idle part. Index = CPU number; missing CPUs stay zero.
inline std::vector<Jiffies> read_proc_stat() {
  std::vector<Jiffies> out;
  std::ifstream in("/proc/stat");
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() < 4 || line.compare(0, 3, "cpu") != 0 || line[3] < '0' || line[3] > '9')
      continue;
    std::istringstream fields(line.substr(3));
    std::size_t cpu = 0;
    fields >> cpu;
    std::vector<std::uint64_t> v;
    std::uint64_t x = 0;
    while (fields >> x) v.push_back(x);
    if (v.size() < 4) continue;
    Jiffies j;
    for (std::size_t i = 0; i < v.size() && i < 8; ++i) {
      j.total += v[i];
      if (i != 3 && i != 4) j.busy += v[i];  // not idle, not iowait
    }
    if (out.size() <= cpu) out.resize(cpu + 1);
    out[cpu] = j;
  }
  return out;
}
}  // namespace threads_detail

/// Samples the load of the cores in this process's affinity mask over `window`. Call it while
/// this process is idle (before training starts): what it measures is everybody else's use.
/// Without /proc/stat it reports the cores and no load.
inline CpuLoad cpu_load(std::chrono::milliseconds window = std::chrono::milliseconds(250)) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<std::size_t> mine;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    for (std::size_t c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) mine.push_back(c);
  }
  CpuLoad load;
  load.cores = mine.empty() ? static_cast<int>(std::max(1U, std::thread::hardware_concurrency()))
                            : static_cast<int>(mine.size());
  const auto before = threads_detail::read_proc_stat();
  std::this_thread::sleep_for(window);
  const auto after = threads_detail::read_proc_stat();
  double busy = 0.0;
  for (const std::size_t c : mine) {
    if (c >= before.size() || c >= after.size()) continue;
    const double total = static_cast<double>(after[c].total - before[c].total);
    if (total <= 0) continue;
    busy += static_cast<double>(after[c].busy - before[c].busy) / total;
  }
  load.busy_elsewhere = busy;
  return load;
}

/// Intra-op threads for `load`: the cores, less the whole cores other processes keep busy
/// (a core counts as taken from 60 % use on), never fewer than one.
inline int threads_for(const CpuLoad& load) {
  const int taken = static_cast<int>(std::floor(load.busy_elsewhere + 0.4));
  return std::max(1, load.cores - taken);
}

}  // namespace difftrain::train
