// A value per device that a launch decides by (an attribute, an occupancy), found once by a CUDA
// call and kept for the process. The launches' plain static arrays that this replaces were
// written by whichever host threads launched first on a device, unsynchronised: a data race.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>

#include <cuda_runtime.h>

namespace gemmfuse {

class DeviceCache {
 public:
  static constexpr int kDevices = 64;  // a device past these is asked at every call

  // The value for `device`: `find(device, value)` (CUDA calls, returning their cudaError_t)
  // asked the first time, its answer kept; every value kept is positive (0 marks "not yet
  // found"). Two threads may both ask at first; they store the same answer. A failed query's
  // error is returned here and cleared from the thread's last error (where it is not sticky),
  // so that a later launch's cudaGetLastError does not report it a second time: `find` returns
  // cudaSuccess or the error of the CUDA call of its own that failed, never one it makes up.
  template <class Find>
  cudaError_t get(int device, int& value, Find&& find) {
    if (device < 0) return cudaErrorInvalidDevice;
    int known = device < kDevices ? slots_[device].load(std::memory_order_relaxed) : 0;
    if (known <= 0) {
      const cudaError_t err = find(device, known);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return err;
      }
      if (known <= 0) return cudaErrorInvalidValue;
      if (device < kDevices) slots_[device].store(known, std::memory_order_relaxed);
    }
    value = known;
    return cudaSuccess;
  }

  // The same for the current device.
  template <class Find>
  cudaError_t current(int& value, Find&& find) {
    int device = 0;
    const cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // as get() clears a failed query's
      return err;
    }
    return get(device, value, static_cast<Find&&>(find));
  }

 private:
  std::atomic<int> slots_[kDevices] = {};
};

// A persistent grid's size: the blocks of `kernel` (`threads` a block, `smem` bytes of dynamic
// shared memory) resident at once on the current device, at least 1, found once per device in
// `cache` (a static beside the launch).
template <class Kernel>
cudaError_t resident_grid(DeviceCache& cache, Kernel kernel, int threads, size_t smem, int& blocks) {
  return cache.current(blocks, [kernel, threads, smem](int device, int& found) {
    int per_sm = 0, sms = 0;
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    found = std::max(1, per_sm * sms);
    return e;
  });
}

}  // namespace gemmfuse
