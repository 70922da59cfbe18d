"""The test bed's SMTP sink: aiosmtpd keeping each message as a maildir file.

Tests steer it through the recipient's local part:
  reject...@     every RCPT answered 550 (a permanent refusal)
  defer...@      the first RCPT of that address answered 451, later ones 250
With --tls-cert and --tls-key it offers STARTTLS with that certificate.

usage: smtp_sink.py PORT MAILDIR [--tls-cert FILE --tls-key FILE]
"""
import argparse
import asyncio
import mailbox
import os
import ssl

from aiosmtpd.controller import Controller


class Sink:
    def __init__(self, maildir):
        for sub in ("tmp", "new", "cur"):
            os.makedirs(os.path.join(maildir, sub), exist_ok=True)
        self.box = mailbox.Maildir(maildir, create=False)
        self.deferred = set()

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        local = address.split("@", 1)[0].lower()
        if local.startswith("reject"):
            return "550 5.1.1 mailbox refused by the test sink"
        if local.startswith("defer") and address not in self.deferred:
            self.deferred.add(address)
            return "451 4.3.0 try again later (test sink)"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        self.box.add(envelope.original_content)
        return "250 2.0.0 queued by the test sink"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("maildir")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    a = p.parse_args()
    tls = None
    if a.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(a.tls_cert, a.tls_key)
    controller = Controller(
        Sink(a.maildir), hostname="127.0.0.1", port=a.port, tls_context=tls,
        require_starttls=tls is not None, data_size_limit=8 * 1024 * 1024,
    )
    controller.start()
    try:
        asyncio.new_event_loop().run_forever()
    finally:
        controller.stop()


if __name__ == "__main__":
    main()
