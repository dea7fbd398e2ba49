// An open POSIX file descriptor, closed on destruction: shared by the safetensors reader and
// the atomic file writer (io/atomic_file.cpp). Private to the io library.
#pragma once

#include <unistd.h>

#include <cerrno>

namespace mixtape::detail {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now; returns 0 or the errno of a failed close.
  int close() {
    const int fd = fd_;
    fd_ = -1;
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

}  // namespace mixtape::detail
