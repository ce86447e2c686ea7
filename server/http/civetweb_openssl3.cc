// HTTPS with Debian's civetweb 1.15 and OpenSSL 3.
//
// Debian builds civetweb to load OpenSSL at run time: it dlopen()s "libssl.so"
// and "libcrypto.so" and looks up each function by name, from the OpenSSL 1.1
// set. One of those names, SSL_get_peer_certificate, is only a macro in
// OpenSSL 3 (for SSL_get1_peer_certificate); civetweb's table entry stays null
// and the first HTTPS connection calls it right after the handshake: SIGSEGV.
//
// The fix without rebuilding civetweb: foreshockd is linked with the SONAME
// "libssl.so" (server/CMakeLists.txt) and exports the missing function below.
// The dynamic loader hands civetweb's dlopen("libssl.so") the already-loaded
// executable, whose dependency libssl.so.3 supplies every other name, and
// this definition supplies the missing one. HttpServer::Start checks that the
// lookup works before it serves HTTPS (server/http/http_server.cc).
//
// Only foreshockd's executable may contain this file: the SONAME trick works
// for the main program, and a static library would drop an unreferenced object.
#include <openssl/ssl.h>

#undef SSL_get_peer_certificate

extern "C" __attribute__((visibility("default"), used)) X509* SSL_get_peer_certificate(
    const SSL* ssl) {
  // Both return a new reference; civetweb releases it with X509_free.
  return SSL_get1_peer_certificate(ssl);
}
