// A FIFO that keeps at most `capacity` elements, dropping the oldest. Storage
// grows with use, so a series with three points costs three slots, not
// `capacity`.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace foreshock::store {

template <typename T>
class BoundedRing {
 public:
  explicit BoundedRing(size_t capacity = 1) : capacity_(std::max<size_t>(1, capacity)) {}

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }
  // Slots allocated so far, for memory accounting.
  size_t allocated() const { return slots_.capacity(); }

  // i = 0 is the oldest element.
  const T& operator[](size_t i) const { return slots_[(head_ + i) % slots_.size()]; }
  const T& front() const { return (*this)[0]; }
  const T& back() const { return (*this)[size_ - 1]; }

  void push_back(T value) {
    if (size_ == slots_.size() && slots_.size() < capacity_) {
      // Still growing: unwrap (only needed after pops) and add a slot.
      std::rotate(slots_.begin(), slots_.begin() + head_, slots_.end());
      head_ = 0;
      slots_.push_back(std::move(value));
      ++size_;
      return;
    }
    if (size_ < slots_.size()) {  // room left by pops
      slots_[(head_ + size_) % slots_.size()] = std::move(value);
      ++size_;
      return;
    }
    slots_[head_] = std::move(value);  // full: overwrite the oldest
    head_ = (head_ + 1) % slots_.size();
  }

  void pop_front() {
    slots_[head_] = T();  // release what the element owns (strings)
    head_ = (head_ + 1) % slots_.size();
    --size_;
  }

  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (size_t i = 0; i < size_; ++i) fn((*this)[i]);
  }

 private:
  size_t capacity_;
  std::vector<T> slots_;
  size_t head_ = 0;  // index of the oldest element
  size_t size_ = 0;
};

}  // namespace foreshock::store
