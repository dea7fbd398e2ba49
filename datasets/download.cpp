// libcurl's easy interface, one handle per download (so downloads on several threads do
// not share state); the global initialisation happens once.
#include "datasets/download.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>

namespace mixtape::datasets {

namespace {

void global_init() {
  static std::once_flag once;
  static CURLcode status = CURLE_OK;
  std::call_once(once, [] { status = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (status != CURLE_OK)
    throw IOError(fmt::format("libcurl: ({}) cannot initialise: {}", static_cast<int>(status),
                              curl_easy_strerror(status)));
}

struct EasyDeleter {
  void operator()(CURL* h) const { curl_easy_cleanup(h); }
};
using Easy = std::unique_ptr<CURL, EasyDeleter>;

// Where the body goes, and why the write callback stopped a transfer.
struct Sink {
  std::FILE* file = nullptr;
  std::string* memory = nullptr;
  std::size_t max_bytes = 0;
  std::string problem = {};  // set when the callback refused the data
};

std::size_t write_body(char* data, std::size_t size, std::size_t count, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const std::size_t n = size * count;
  if (sink->file != nullptr) {
    if (std::fwrite(data, 1, n, sink->file) != n) {
      sink->problem = fmt::format("cannot write the download: {}", std::strerror(errno));
      return 0;  // libcurl stops with CURLE_WRITE_ERROR
    }
    return n;
  }
  if (sink->memory->size() + n > sink->max_bytes) {
    sink->problem = fmt::format("the body is larger than the {} bytes allowed", sink->max_bytes);
    return 0;
  }
  sink->memory->append(data, n);
  return n;
}

template <typename T>
void set(CURL* h, CURLoption option, T value) {
  const CURLcode rc = curl_easy_setopt(h, option, value);
  if (rc != CURLE_OK)
    throw IOError(fmt::format("libcurl: ({}) cannot set option {}: {}", static_cast<int>(rc),
                              static_cast<int>(option), curl_easy_strerror(rc)));
}

void perform(const std::string& url, const Timeouts& timeouts, Sink& sink) {
  global_init();
  Easy easy(curl_easy_init());
  if (!easy) throw IOError("libcurl: cannot create a transfer handle (out of memory)");
  CURL* h = easy.get();
  char error[CURL_ERROR_SIZE] = {0};
  set(h, CURLOPT_ERRORBUFFER, error);
  set(h, CURLOPT_URL, url.c_str());
  set(h, CURLOPT_PROTOCOLS_STR, "http,https,file");
  set(h, CURLOPT_FOLLOWLOCATION, 1L);
  set(h, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  set(h, CURLOPT_MAXREDIRS, 10L);
  set(h, CURLOPT_FAILONERROR, 1L);  // an HTTP status >= 400 is an error, not a body
  set(h, CURLOPT_NOSIGNAL, 1L);     // no SIGALRM for timeouts: safe on any thread
  set(h, CURLOPT_CONNECTTIMEOUT, static_cast<long>(std::max(1, timeouts.connect_s)));
  set(h, CURLOPT_TIMEOUT, static_cast<long>(std::max(1, timeouts.transfer_s)));
  set(h, CURLOPT_USERAGENT, "mixtape (libcurl/" LIBCURL_VERSION ")");
  set(h, CURLOPT_WRITEFUNCTION, &write_body);
  set(h, CURLOPT_WRITEDATA, static_cast<void*>(&sink));

  const CURLcode rc = curl_easy_perform(h);
  if (rc == CURLE_OK) return;
  std::string reason = error[0] != '\0' ? std::string(error) : curl_easy_strerror(rc);
  while (!reason.empty() && (reason.back() == '\n' || reason.back() == ' ')) reason.pop_back();
  if (rc == CURLE_WRITE_ERROR && !sink.problem.empty()) reason = sink.problem;
  const std::string what = fmt::format("libcurl: ({}) {}", static_cast<int>(rc), reason);
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
      throw DownloadError(what, DownloadError::Scope::Host, "the host is unreachable");
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_CACERT_BADFILE:
      throw DownloadError(what, DownloadError::Scope::Host, "TLS with the host failed");
    default:
      throw DownloadError(what, DownloadError::Scope::Url);
  }
}

}  // namespace

void download_to_file(const std::string& url, const std::filesystem::path& out,
                      const Timeouts& timeouts) {
  std::FILE* f = std::fopen(out.c_str(), "wb");
  if (f == nullptr)
    throw IOError(fmt::format("cannot create {}: {}", out.string(), std::strerror(errno)));
  Sink sink{.file = f};
  try {
    perform(url, timeouts, sink);
  } catch (...) {
    std::fclose(f);
    throw;
  }
  if (std::fclose(f) != 0)
    throw IOError(fmt::format("cannot write {}: {}", out.string(), std::strerror(errno)));
}

std::string download_to_memory(const std::string& url, const Timeouts& timeouts,
                               std::size_t max_bytes) {
  std::string body;
  Sink sink{.memory = &body, .max_bytes = max_bytes};
  perform(url, timeouts, sink);
  return body;
}

}  // namespace mixtape::datasets
