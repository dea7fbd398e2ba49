// Message digests, private to the library: the dataset loaders check fetched files against
// known SHA-256 digests, and npm tarballs against the registry's SHA-512 integrity string.
// OpenSSL's libcrypto computes them (its EVP interface); this wrapper adds the hex and
// base64 forms, one-shot helpers and mixtape errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX, kept out of this header

namespace mixtape::datasets {

// An incremental digest: update() with the bytes in order, then digest() or hex_digest()
// once; updating or finishing again afterwards throws ValueError.
class Digest {
 public:
  enum class Algorithm { Sha256, Sha512 };

  explicit Digest(Algorithm algorithm);
  ~Digest();
  Digest(Digest&& other) noexcept;
  Digest& operator=(Digest&& other) noexcept;
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;

  void update(const void* data, std::size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }
  // The digest (32 bytes for SHA-256, 64 for SHA-512); the digest is finished.
  std::vector<std::uint8_t> digest();
  // The digest as lowercase hex digits.
  std::string hex_digest();

 private:
  const char* name() const;

  Algorithm algorithm_;
  evp_md_ctx_st* ctx_ = nullptr;
  bool finished_ = false;
};

// SHA-256 (FIPS 180-4).
class Sha256 : public Digest {
 public:
  Sha256() : Digest(Algorithm::Sha256) {}
};

// SHA-512 (FIPS 180-4).
class Sha512 : public Digest {
 public:
  Sha512() : Digest(Algorithm::Sha512) {}
};

// The SHA-256 of `bytes` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);

// `bytes` in standard base64 (RFC 4648, with '=' padding), as npm's integrity strings
// ("sha512-<base64>") write digests.
std::string base64(const std::vector<std::uint8_t>& bytes);

}  // namespace mixtape::datasets
