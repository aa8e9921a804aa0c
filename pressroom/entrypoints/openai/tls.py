"""HTTPS as vLLM's `--ssl-*` flags ask for it: uvicorn wraps the socket the server bound before the model loaded
(run_server), so the certificate is checked here first, before the load, and a bad file stops the start at once.
`--enable-ssl-refresh` reloads the key and certificates into the live context when their files change: new
connections get the new certificate, open ones keep theirs."""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

logger = logging.getLogger("pressroom")

REFRESH_POLL_S = 1.0  # how often --enable-ssl-refresh looks at the files' modification times


@dataclass(frozen=True, slots=True, kw_only=True)
class TLSSettings:
    certfile: str
    keyfile: str | None = None  # None: the key is in certfile
    ca_certs: str | None = None  # CA certificates that client certificates are checked against
    cert_reqs: int = int(ssl.CERT_NONE)  # ssl.CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED: client certificates
    ciphers: str | None = None  # OpenSSL cipher list (TLS 1.2 and below)
    refresh: bool = False  # reload the files when they change

    def __post_init__(self) -> None:
        if self.cert_reqs not in {int(r) for r in ssl.VerifyMode}:
            raise ValueError(f"--ssl-cert-reqs {self.cert_reqs}: one of 0 (none), 1 (optional), 2 (required): "
                             "whether clients must present a certificate.")
        if self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise ValueError("--ssl-cert-reqs asks for client certificates: give --ssl-ca-certs to check them "
                             "against.")

    @classmethod
    def from_flags(cls, keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int,
                   ciphers: str | None, refresh: bool) -> TLSSettings | None:
        """None (plain HTTP) without --ssl-certfile; a ValueError for TLS flags given without one."""
        if certfile is None:
            given = [name for name, value in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs),
                                              ("--ssl-ciphers", ciphers), ("--enable-ssl-refresh", refresh))
                     if value]
            if given or cert_reqs != ssl.CERT_NONE:
                raise ValueError(f"{(given or ['--ssl-cert-reqs'])[0]} needs --ssl-certfile: HTTPS is served with a "
                                 "certificate.")
            return None
        return cls(certfile=certfile, keyfile=keyfile, ca_certs=ca_certs, cert_reqs=cert_reqs, ciphers=ciphers,
                   refresh=refresh)

    def uvicorn_kwargs(self) -> dict:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs, "ssl_ciphers": self.ciphers}

    def check(self) -> None:
        """A ValueError naming the file or setting that uvicorn would fail on, before the model loads."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        for path, flag in ((self.certfile, "--ssl-certfile"), (self.keyfile, "--ssl-keyfile"),
                           (self.ca_certs, "--ssl-ca-certs")):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: no such file.")
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-certfile {self.certfile!r} / --ssl-keyfile {self.keyfile!r}: not a certificate "
                             f"and its private key ({e})") from None
        try:
            if self.ca_certs is not None:
                context.load_verify_locations(self.ca_certs)
            if self.ciphers is not None:
                context.set_ciphers(self.ciphers)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs / --ssl-ciphers: {e}") from None

    def _files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.certfile, self.keyfile, self.ca_certs) if p is not None)

    def _stamps(self) -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime_ns if os.path.exists(p) else -1 for p in self._files())

    async def refresh_forever(self, context: ssl.SSLContext) -> None:
        """Reloads the files into `context` (uvicorn's, serving) whenever one changes; a broken new file is logged
        and the context keeps what it had."""
        seen = self._stamps()
        while True:
            await asyncio.sleep(REFRESH_POLL_S)
            now = self._stamps()
            if now == seen:
                continue
            seen = now
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
                if self.ca_certs is not None:
                    context.load_verify_locations(self.ca_certs)
            except (ssl.SSLError, OSError) as e:
                logger.error("--enable-ssl-refresh: could not reload %s (%s); serving the previous certificate",
                             ", ".join(self._files()), e)
                continue
            logger.info("reloaded the TLS certificate (%s)", ", ".join(self._files()))
