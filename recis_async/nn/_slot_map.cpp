// Native probe loops for recis_async.nn.slot_map.NativeSlotMap.
//
// The table layout is the torch-ops SlotMap's own: `kv` holds (key, value) pairs of
// `1 << bits` positions plus one scratch pair, a value is a slot (>= 0), EMPTY (-1) or
// TOMB (-2); `slot_pos[slot]` is the position holding the slot's key.  The arrays are torch
// tensors owned by Python; these functions only read and write them, so either map can
// work on the other's state.  The caller serialises calls (the table's lock).
//
// Inserting is split in two so that slots are allocated once per batch by Python: `claim`
// writes each absent key into its first empty position with a pending value (-3 - j for the
// j-th new key) so later duplicates of the batch find it, `resolve` swaps in the allocated
// slots, `revert` empties the claimed positions again if allocation failed.
#include <cstdint>

namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kTomb = -2;
constexpr int64_t kPending = -3;  // pending value of new key j: kPending - j
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int64_t kAhead = 16;  // ids whose home position is prefetched ahead of the probe

inline uint64_t home(int64_t id, int bits) {
  return (static_cast<uint64_t>(id) * kGolden) >> (64 - bits);
}

inline void prefetch(const int64_t* kv, const int64_t* ids, int64_t i, int64_t n, int bits) {
  if (i < n) __builtin_prefetch(kv + 2 * home(ids[i], bits), 1, 0);
}

}  // namespace

extern "C" {

// out[i] = slot of ids[i], or EMPTY.
void slot_map_find(const int64_t* kv, int bits, const int64_t* ids, int64_t n, int64_t* out) {
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  for (int64_t i = 0; i < kAhead && i < n; ++i) prefetch(kv, ids, i, n, bits);
  for (int64_t i = 0; i < n; ++i) {
    prefetch(kv, ids, i + kAhead, n, bits);
    const int64_t id = ids[i];
    uint64_t p = home(id, bits);
    int64_t found = kEmpty;
    for (;;) {
      const int64_t v = kv[2 * p + 1];
      if (v == kEmpty) break;
      if (v >= 0 && kv[2 * p] == id) {
        found = v;
        break;
      }
      p = (p + 1) & mask;
    }
    out[i] = found;
  }
}

// out[i] = slot of ids[i], or kPending - j when ids[i] is the j-th key claimed by this call
// (its position stored in new_pos[j]).  Returns the number of claimed keys.  The caller
// guarantees room: the table stays at most half full.
int64_t slot_map_claim(int64_t* kv, int bits, const int64_t* ids, int64_t n, int64_t* out,
                       int64_t* new_pos) {
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  int64_t claimed = 0;
  for (int64_t i = 0; i < kAhead && i < n; ++i) prefetch(kv, ids, i, n, bits);
  for (int64_t i = 0; i < n; ++i) {
    prefetch(kv, ids, i + kAhead, n, bits);
    const int64_t id = ids[i];
    uint64_t p = home(id, bits);
    for (;;) {
      const int64_t v = kv[2 * p + 1];
      if (v == kEmpty) {
        kv[2 * p] = id;
        kv[2 * p + 1] = kPending - claimed;
        new_pos[claimed] = static_cast<int64_t>(p);
        out[i] = kPending - claimed;
        ++claimed;
        break;
      }
      if (v != kTomb && kv[2 * p] == id) {
        out[i] = v;
        break;
      }
      p = (p + 1) & mask;
    }
  }
  return claimed;
}

// Give the k claimed keys their slots and replace pending values in out[0..n).
void slot_map_resolve(int64_t* kv, int64_t* slot_pos, const int64_t* new_pos,
                      const int64_t* slots, int64_t k, int64_t* out, int64_t n) {
  for (int64_t j = 0; j < k; ++j) {
    kv[2 * new_pos[j] + 1] = slots[j];
    slot_pos[slots[j]] = new_pos[j];
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = out[i];
    if (v <= kPending) out[i] = slots[kPending - v];
  }
}

// Undo a claim: the k claimed positions become empty again.  Every key claimed after one of
// them is undone too, so no probe chain of a remaining key runs through them.
void slot_map_revert(int64_t* kv, const int64_t* new_pos, int64_t k) {
  for (int64_t j = 0; j < k; ++j) kv[2 * new_pos[j] + 1] = kEmpty;
}

}  // extern "C"
