"""TLS and bearer tokens for the connections to foreshockd.

    sec = Security(token="...", tls_ca="ca.pem", tls_cert="client.pem", tls_key="client.key")
    channel = sec.channel("host:50051")           # secure when any TLS file is given
    stub.ListRuns(request, metadata=sec.metadata)  # ("authorization", "Bearer ...")

The token defaults to $FORESHOCK_TOKEN. Without TLS files the channel is
plaintext (fine on loopback; the daemon refuses plaintext on other addresses
unless started with --insecure). Tokens are never logged here.
"""
import os

import grpc


def _read(path):
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class Security:
    def __init__(self, token=None, tls_ca=None, tls_cert=None, tls_key=None):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.token = token if token is not None else os.environ.get("FORESHOCK_TOKEN") or None
        self.tls = tls_ca is not None or tls_cert is not None
        # Read once: a missing file fails at construction, not on every reconnect.
        self._ca, self._cert, self._key = _read(tls_ca), _read(tls_cert), _read(tls_key)

    @property
    def metadata(self):
        """gRPC call metadata carrying the token (None without one)."""
        return (("authorization", "Bearer " + self.token),) if self.token else None

    def channel(self, endpoint, options=()):
        if not self.tls:
            return grpc.insecure_channel(endpoint, options=list(options))
        credentials = grpc.ssl_channel_credentials(root_certificates=self._ca,
                                                   private_key=self._key,
                                                   certificate_chain=self._cert)
        return grpc.secure_channel(endpoint, credentials, options=list(options))

    def __repr__(self):  # never shows the token
        return f"Security(token={'set' if self.token else 'none'}, tls={self.tls})"
