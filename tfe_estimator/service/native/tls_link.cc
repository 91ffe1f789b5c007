// The owner's data-plane client connection in C: BoringSSL (as TensorFlow ships it) does the TLS.
//
// One connection carries one call at a time (tfe_estimator/service/frames.py's framing): the request's
// prefix (header, head, meta) and its payload are written with SSL_write straight from the caller's
// buffers, the reply's 16-byte header is read and checked, and its message is read with SSL_read straight
// into the caller's buffer. The socket is non-blocking; every wait is a poll() bounded by the call's
// deadline. No function here touches Python: tfe_estimator/service/native_link.py calls them with ctypes,
// which releases the GIL for each call.
//
// Pinning (the same as TlsFiles.ssl_client_context + server_hostname): the server's operator's CA only (no
// default paths), the server's DNS name (X509_VERIFY_PARAM_set1_host, no partial wildcards), the owner's certificate chain
// and key presented, TLS 1.2 with forward-secret AEAD suites only, or TLS 1.3.
//
// Writes to a socket the server closed raise SIGPIPE, which Python ignores (its default since 2.x); a host
// process that does not must ignore it too.
//
// Mutations for tests only (compile-time, never in a shipped build): TFE_LINK_MUTATION_NO_NAME_CHECK skips
// the name check; TFE_LINK_MUTATION_NO_CA_CHECK accepts a chain that does not reach the pinned CA.
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <string>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

namespace {

// TLS 1.2 suites: forward-secret AEAD only (tls.py's _TLS12_CIPHERS, "ECDHE+AESGCM:ECDHE+CHACHA20").
const char kTls12Ciphers[] =
    "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:"
    "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305";
const char kReplyMagic[4] = {'T', 'F', 'R', '1'};  // a reply's magic (frames.REPLY)

// Status of tfe_link_call / tfe_link_read.
enum { kOk = 0, kLarger = 1, kFailed = -1, kTimeout = -2, kEnded = -3 };

double Now() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

void SetError(char* err, size_t len, const std::string& text) {
  if (err == nullptr || len == 0) return;
  snprintf(err, len, "%s", text.c_str());
}

// The TLS library's first queued error as text (empty if none), and the queue cleared.
std::string TlsErrors() {
  std::string text;
  uint32_t code;
  while ((code = ERR_get_error()) != 0) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    if (!text.empty()) text += "; ";
    text += buffer;
  }
  return text;
}

#ifdef TFE_LINK_MUTATION_NO_CA_CHECK
// The planted leak: every chain error is ignored except the name's.
int AcceptAnyIssuer(int ok, X509_STORE_CTX* store) {
  return ok || X509_STORE_CTX_get_error(store) == X509_V_ERR_HOSTNAME_MISMATCH ? ok : 1;
}
#endif

}  // namespace

struct tfe_link_ctx {
  SSL_CTX* ssl;
  std::string hostname;
};

struct tfe_conn {
  int fd;
  SSL* ssl;
};

namespace {

// Waits until `fd` is ready for `events` or the deadline passes: kOk, kTimeout or kFailed.
int Wait(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - Now();
    if (left <= 0) return kTimeout;
    struct pollfd p = {fd, events, 0};
    int ms = left > INT_MAX / 1000 ? INT_MAX : static_cast<int>(left * 1000) + 1;
    int n = poll(&p, 1, ms);
    if (n > 0) return kOk;
    if (n == 0) continue;  // the deadline is rechecked
    if (errno != EINTR) return kFailed;
  }
}

// After an SSL call returned `ret` <= 0: waits for what it needs (kOk: call it again), else why it failed.
int Retry(tfe_conn* conn, int ret, double deadline, std::string* why) {
  int error = SSL_get_error(conn->ssl, ret);
  if (error == SSL_ERROR_WANT_READ) {
    int waited = Wait(conn->fd, POLLIN, deadline);
    if (waited != kOk && why->empty()) *why = "poll failed: " + std::string(strerror(errno));
    return waited;
  }
  if (error == SSL_ERROR_WANT_WRITE) {
    int waited = Wait(conn->fd, POLLOUT, deadline);
    if (waited != kOk && why->empty()) *why = "poll failed: " + std::string(strerror(errno));
    return waited;
  }
  if (error == SSL_ERROR_ZERO_RETURN) {
    *why = "the server closed the connection";
    return kEnded;
  }
  if (error == SSL_ERROR_SYSCALL) {
    int saved = errno;
    std::string queued = TlsErrors();
    *why = !queued.empty() ? queued : saved != 0 ? std::string(strerror(saved)) : "the server closed the connection";
    return saved == 0 && queued.empty() ? kEnded : kFailed;
  }
  *why = TlsErrors();
  if (why->empty()) *why = "TLS error " + std::to_string(error);
  return kFailed;
}

int WriteAll(tfe_conn* conn, const uint8_t* data, uint64_t len, double deadline, std::string* why) {
  while (len > 0) {
    int chunk = len > (1u << 30) ? (1 << 30) : static_cast<int>(len);
    ERR_clear_error();
    errno = 0;  // SSL_ERROR_SYSCALL reads it
    int n = SSL_write(conn->ssl, data, chunk);
    if (n > 0) {
      data += n;
      len -= static_cast<uint64_t>(n);
      continue;
    }
    int status = Retry(conn, n, deadline, why);
    if (status != kOk) return status;
  }
  return kOk;
}

// Reads exactly `len` bytes into `data`; kEnded if the stream ended (`*got` says after how many).
int ReadAll(tfe_conn* conn, uint8_t* data, uint64_t len, double deadline, uint64_t* got, std::string* why) {
  *got = 0;
  while (*got < len) {
    uint64_t left = len - *got;
    int chunk = left > (1u << 30) ? (1 << 30) : static_cast<int>(left);
    ERR_clear_error();
    errno = 0;  // SSL_ERROR_SYSCALL reads it
    int n = SSL_read(conn->ssl, data + *got, chunk);
    if (n > 0) {
      *got += static_cast<uint64_t>(n);
      continue;
    }
    int status = Retry(conn, n, deadline, why);
    if (status != kOk) return status;
  }
  return kOk;
}

int ConnectTcp(const char* host, int port, double deadline, std::string* why) {
  struct addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* found = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host, service.c_str(), &hints, &found);
  if (rc != 0) {
    *why = gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (struct addrinfo* a = found; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      *why = strerror(errno);
      continue;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    if (errno == EINPROGRESS) {
      int waited = Wait(fd, POLLOUT, deadline);
      int error = 0;
      socklen_t size = sizeof(error);
      if (waited == kOk && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) == 0 && error == 0) break;
      *why = waited == kTimeout ? "timed out" : strerror(error != 0 ? error : errno);
    } else {
      *why = strerror(errno);
    }
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd >= 0) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

}  // namespace

extern "C" {

// A client context pinned to one server: NULL on failure (`err` says why).
tfe_link_ctx* tfe_link_ctx_new(const char* ca_pem, size_t ca_len, const char* cert_path, const char* key_path,
                               const char* hostname, char* err, size_t err_len) {
  ERR_clear_error();
  SSL_CTX* ssl = SSL_CTX_new(TLS_method());
  if (ssl == nullptr) {
    SetError(err, err_len, "SSL_CTX_new failed: " + TlsErrors());
    return nullptr;
  }
  std::string why;
  X509_STORE* store = SSL_CTX_get_cert_store(ssl);  // empty: no default paths, the pinned CA only
  BIO* bio = BIO_new_mem_buf(ca_pem, static_cast<int>(ca_len));
  int roots = 0;
  X509* cert;
  while (bio != nullptr && (cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) != nullptr) {
    if (X509_STORE_add_cert(store, cert)) roots++;
    X509_free(cert);
  }
  BIO_free(bio);
  ERR_clear_error();  // the end of the PEM data is queued as an error
  if (roots == 0) {
    why = "the server's CA certificate (PEM) holds no certificate";
  } else if (!SSL_CTX_set_min_proto_version(ssl, TLS1_2_VERSION) ||
             !SSL_CTX_set_max_proto_version(ssl, TLS1_3_VERSION) ||
             !SSL_CTX_set_strict_cipher_list(ssl, kTls12Ciphers)) {
    why = "TLS versions or suites refused: " + TlsErrors();
  } else if (SSL_CTX_use_certificate_chain_file(ssl, cert_path) != 1) {
    why = std::string("cannot load the certificate chain ") + cert_path + ": " + TlsErrors();
  } else if (SSL_CTX_use_PrivateKey_file(ssl, key_path, SSL_FILETYPE_PEM) != 1 ||
             SSL_CTX_check_private_key(ssl) != 1) {
    why = std::string("cannot load the key ") + key_path + " (or it is not the certificate's): " + TlsErrors();
  }
  if (!why.empty()) {
    SSL_CTX_free(ssl);
    SetError(err, err_len, why);
    return nullptr;
  }
#ifdef TFE_LINK_MUTATION_NO_CA_CHECK
  SSL_CTX_set_verify(ssl, SSL_VERIFY_PEER, AcceptAnyIssuer);
#else
  SSL_CTX_set_verify(ssl, SSL_VERIFY_PEER, nullptr);
#endif
  SSL_CTX_set_mode(ssl, SSL_MODE_ENABLE_PARTIAL_WRITE);
  return new tfe_link_ctx{ssl, hostname};
}

void tfe_link_ctx_free(tfe_link_ctx* ctx) {
  if (ctx == nullptr) return;
  SSL_CTX_free(ctx->ssl);
  delete ctx;
}

// A connection to host:port with its TLS handshake done within `timeout` seconds; NULL on failure (`err`
// says why; `*stage` 1: TCP, 2: TLS).
tfe_conn* tfe_link_connect(tfe_link_ctx* ctx, const char* host, int port, double timeout, int* stage, char* err,
                           size_t err_len) {
  double deadline = Now() + timeout;
  std::string why;
  *stage = 1;
  int fd = ConnectTcp(host, port, deadline, &why);
  if (fd < 0) {
    SetError(err, err_len, why);
    return nullptr;
  }
  *stage = 2;
  ERR_clear_error();
  SSL* ssl = SSL_new(ctx->ssl);
  tfe_conn* conn = new tfe_conn{fd, ssl};
  bool ready = ssl != nullptr && SSL_set_fd(ssl, fd) == 1 &&
               SSL_set_tlsext_host_name(ssl, ctx->hostname.c_str()) == 1;
#ifndef TFE_LINK_MUTATION_NO_NAME_CHECK
  if (ready) {
    // The name check (X509_VERIFY_PARAM: older BoringSSL, e.g. TensorFlow 2.9's, has no SSL_set1_host).
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    ready = X509_VERIFY_PARAM_set1_host(param, ctx->hostname.data(), ctx->hostname.size()) == 1;
  }
#endif
  if (!ready) why = "cannot set up the connection: " + TlsErrors();
  while (ready) {
    ERR_clear_error();
    errno = 0;  // SSL_ERROR_SYSCALL reads it
    int ret = SSL_connect(ssl);
    if (ret == 1) break;
    long verify = SSL_get_verify_result(ssl);
    int status = Retry(conn, ret, deadline, &why);
    if (status == kOk) continue;
    if (status == kTimeout) why = "the handshake timed out";
    if (status == kFailed && verify != X509_V_OK && verify != X509_V_ERR_INVALID_CALL) {
      why += std::string(" (certificate verify failed: ") + X509_verify_cert_error_string(verify) + ")";
    }
    ready = false;
  }
  if (!ready) {
    if (ssl != nullptr) SSL_free(ssl);
    close(fd);
    delete conn;
    SetError(err, err_len, why);
    return nullptr;
  }
  return conn;
}

// 1 if an idle connection has something to read (the server closed it, or sent what it should not).
int tfe_link_stale(tfe_conn* conn) {
  if (SSL_pending(conn->ssl) > 0) return 1;
  struct pollfd p = {conn->fd, POLLIN | POLLPRI, 0};
  int n = poll(&p, 1, 0);
  return n != 0;  // ready, or poll failed
}

// Ends a call in progress on `conn` from another thread (its reads and writes fail at once).
void tfe_link_shutdown(tfe_conn* conn) { shutdown(conn->fd, SHUT_RDWR); }

void tfe_link_close(tfe_conn* conn) {
  if (conn == nullptr) return;
  SSL_free(conn->ssl);  // no close_notify: a failed connection is never reused, an idle one just goes
  close(conn->fd);
  delete conn;
}

// One call: writes `prefix` (the request's header, head and meta) and `payload`, reads the reply's header.
// kOk: `*code`, `*flags`, `*length` set and the message read into `into` (it fits); kLarger: it does not fit
// `into_len` (read it with tfe_link_read into a buffer of `*length` bytes); kFailed, kTimeout, kEnded: `err`
// says why. Everything within `timeout` seconds.
int tfe_link_call(tfe_conn* conn, const uint8_t* prefix, uint64_t prefix_len, const uint8_t* payload,
                  uint64_t payload_len, uint8_t* into, uint64_t into_len, double timeout, int* code, int* flags,
                  uint64_t* length, char* err, size_t err_len) {
  double deadline = Now() + timeout;
  std::string why;
  int status = WriteAll(conn, prefix, prefix_len, deadline, &why);
  if (status == kOk) status = WriteAll(conn, payload, payload_len, deadline, &why);
  uint8_t header[16];
  uint64_t got = 0;
  if (status == kOk) {
    status = ReadAll(conn, header, sizeof(header), deadline, &got, &why);
    if (status == kEnded) why = got == 0 ? "the server closed the connection without an answer"
                                         : "the server closed the connection inside its answer's header";
  }
  if (status == kOk) {
    if (memcmp(header, kReplyMagic, 4) != 0 || header[6] != 0 || header[7] != 0) {
      why = "the server's answer is not a data-plane reply (magic " + std::string(reinterpret_cast<char*>(header), 4) +
            ")";
      status = kFailed;
    } else {
      *code = header[4];
      *flags = header[5];
      uint64_t n = 0;
      for (int i = 7; i >= 0; i--) n = (n << 8) | header[8 + i];
      *length = n;
      if (n > into_len) return kLarger;
      status = ReadAll(conn, into, n, deadline, &got, &why);
      if (status == kEnded) why = "the server closed the connection inside its answer";
    }
  }
  if (status != kOk) SetError(err, err_len, why);
  return status;
}

// The rest of a kLarger answer: `len` bytes into `into`, within `timeout` seconds.
int tfe_link_read(tfe_conn* conn, uint8_t* into, uint64_t len, double timeout, char* err, size_t err_len) {
  std::string why;
  uint64_t got = 0;
  int status = ReadAll(conn, into, len, Now() + timeout, &got, &why);
  if (status == kEnded) why = "the server closed the connection inside its answer";
  if (status != kOk) SetError(err, err_len, why);
  return status;
}

}  // extern "C"
