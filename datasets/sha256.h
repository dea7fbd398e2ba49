// SHA-256 (FIPS 180-4), private to the library: the dataset loaders check downloaded
// files against known digests with it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mixtape::datasets {

// An incremental SHA-256 hash: update() with the bytes in order, then hex_digest() (or
// digest()) once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }
  // The 32-byte digest; the hash is finished and must not be updated afterwards.
  std::array<std::uint8_t, 32> digest();
  // The digest as 64 lowercase hex digits.
  std::string hex_digest();

 private:
  void compress(const std::uint8_t* block);

  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t length_ = 0;  // bytes hashed so far
  bool finished_ = false;
};

// The SHA-256 of `bytes` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);

}  // namespace mixtape::datasets
