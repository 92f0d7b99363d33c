// Streams, events and the device allocator's statistics, which tch 0.26 does not expose:
// what staged gradients need to cross to the host on a side stream while backward goes on,
// and what `bench memory` reads as a device's peak. Device-generic through c10's guard
// interface and events (no CUDA headers: the same file builds against the CPU libtorch and
// the GPU kit's). GPU only: on the CPU the callers take their synchronous twin and never
// call these (c10 registers no streams for the CPU).
#include <ATen/core/Tensor.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <memory>
#include <optional>

// Each returns 0, or 1 when libtorch threw (nothing is left half done then).

// A stream from the pool of device (`type`, `index`), as its id (with the device, what
// names a c10 stream).
extern "C" int limpet_side_stream(int type, int index, int64_t *id) {
  try {
    c10::Device d(static_cast<c10::DeviceType>(type), static_cast<c10::DeviceIndex>(index));
    c10::impl::VirtualGuardImpl guard(d.type());
    *id = guard.getStreamFromGlobalPool(d, /*isHighPriority=*/false).id();
    return 0;
  } catch (...) {
    return 1;
  }
}

// Copies `src` (on a device) into `dst` (page-locked host memory of the same size) on the
// side stream `id` of `src`'s device, after everything enqueued so far on the device's
// current stream, without waiting for it: `*done` is an event that completes with the copy
// (free it with `limpet_event_free`, after `limpet_event_wait`).
extern "C" int limpet_copy_on_side(at::Tensor *dst, at::Tensor *src, int64_t id, void **done) {
  // Once the copy is enqueued, a failure must not return before it ends: the caller would
  // write the destination while it is still being copied into.
  std::optional<c10::Stream> enqueued;
  try {
    const c10::Device d = src->device();
    c10::impl::VirtualGuardImpl guard(d.type());
    const c10::Stream side(c10::Stream::UNSAFE, d, static_cast<c10::StreamId>(id));
    // The side stream waits for the compute stream's work so far (the bucket's backward).
    c10::Event ready(d.type());
    ready.record(guard.getStream(d));
    ready.block(side);
    {
      c10::StreamGuard on_side(side);
      dst->copy_(*src, /*non_blocking=*/true);
    }
    enqueued = side;
    // The source's memory is the side stream's too until the copy ends: the caching
    // allocator must not hand it out before.
    guard.recordDataPtrOnStream(src->storage().data_ptr(), side);
    auto event = std::make_unique<c10::Event>(d.type());
    event->record(side);
    *done = event.release();
    return 0;
  } catch (...) {
    if (enqueued.has_value()) {
      try {
        enqueued->synchronize();
      } catch (...) {
      }
    }
    return 1;
  }
}

// Blocks the calling thread until `event` has completed.
extern "C" int limpet_event_wait(void *event) {
  try {
    static_cast<c10::Event *>(event)->synchronize();
    return 0;
  } catch (...) {
    return 1;
  }
}

extern "C" void limpet_event_free(void *event) { delete static_cast<c10::Event *>(event); }

// The device allocator's bytes allocated now and at their peak (since the last reset, which
// `reset` asks for after reading), over every pool of device (`type`, `index`).
extern "C" int limpet_device_memory(int type, int index, int64_t *current, int64_t *peak,
                                    int reset) {
  try {
    auto *allocator = c10::getDeviceAllocator(static_cast<c10::DeviceType>(type));
    const auto stats = allocator->getDeviceStats(static_cast<c10::DeviceIndex>(index));
    const auto &all = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    *current = all.current;
    *peak = all.peak;
    if (reset != 0) {
      allocator->resetPeakStats(static_cast<c10::DeviceIndex>(index));
    }
    return 0;
  } catch (...) {
    return 1;
  }
}
