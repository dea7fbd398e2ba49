// Digests on OpenSSL's EVP interface (libcrypto, which libcurl links on Debian anyway).
#include "datasets/digest.h"

#include <fmt/format.h>
#include <openssl/err.h>
#include <openssl/evp.h>

#include <utility>

#include "mixtape/core/error.h"

namespace mixtape::datasets {

namespace {

// OpenSSL's last error as text (or `fallback` when its queue is empty).
std::string openssl_reason(const char* fallback) {
  const unsigned long code = ERR_get_error();
  if (code == 0) return fallback;
  char buf[256];
  ERR_error_string_n(code, buf, sizeof(buf));
  ERR_clear_error();
  return buf;
}

}  // namespace

Digest::Digest(Algorithm algorithm) : algorithm_(algorithm), ctx_(EVP_MD_CTX_new()) {
  if (ctx_ == nullptr) throw Error(fmt::format("{}: out of memory (EVP_MD_CTX_new)", name()));
  const EVP_MD* md = algorithm == Algorithm::Sha256 ? EVP_sha256() : EVP_sha512();
  if (EVP_DigestInit_ex(ctx_, md, nullptr) != 1) {
    const std::string reason = openssl_reason("EVP_DigestInit_ex failed");
    EVP_MD_CTX_free(ctx_);
    throw Error(fmt::format("{}: cannot start the digest: {}", name(), reason));
  }
}

Digest::~Digest() { EVP_MD_CTX_free(ctx_); }

Digest::Digest(Digest&& other) noexcept
    : algorithm_(other.algorithm_),
      ctx_(std::exchange(other.ctx_, nullptr)),
      finished_(other.finished_) {}

Digest& Digest::operator=(Digest&& other) noexcept {
  if (this != &other) {
    EVP_MD_CTX_free(ctx_);
    algorithm_ = other.algorithm_;
    ctx_ = std::exchange(other.ctx_, nullptr);
    finished_ = other.finished_;
  }
  return *this;
}

const char* Digest::name() const { return algorithm_ == Algorithm::Sha256 ? "SHA-256" : "SHA-512"; }

void Digest::update(const void* data, std::size_t size) {
  if (finished_ || ctx_ == nullptr)
    throw ValueError(fmt::format("{}: update after the digest was taken", name()));
  if (size == 0) return;
  if (EVP_DigestUpdate(ctx_, data, size) != 1)
    throw Error(fmt::format("{}: {}", name(), openssl_reason("EVP_DigestUpdate failed")));
}

std::vector<std::uint8_t> Digest::digest() {
  if (finished_ || ctx_ == nullptr)
    throw ValueError(fmt::format("{}: the digest was already taken", name()));
  std::vector<std::uint8_t> out(EVP_MAX_MD_SIZE);
  unsigned int n = 0;
  if (EVP_DigestFinal_ex(ctx_, out.data(), &n) != 1)
    throw Error(fmt::format("{}: {}", name(), openssl_reason("EVP_DigestFinal_ex failed")));
  finished_ = true;
  out.resize(n);
  return out;
}

std::string Digest::hex_digest() {
  std::string out;
  for (std::uint8_t b : digest()) out += fmt::format("{:02x}", b);
  return out;
}

std::string sha256_hex(std::string_view bytes) {
  Sha256 h;
  h.update(bytes);
  return h.hex_digest();
}

std::string base64(const std::vector<std::uint8_t>& bytes) {
  // EVP_EncodeBlock writes 4 characters per 3 bytes (rounded up) and a terminating NUL.
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), bytes.data(),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

}  // namespace mixtape::datasets
