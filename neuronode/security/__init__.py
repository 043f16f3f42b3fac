"""Building blocks of a closed swarm: who may join, and proof that a message came from a member.

- `certs`: a swarm certificate authority and node certificates for mutual TLS (the transport
  proves both ends hold a certificate from the swarm's CA), plus the `neuronode ca` commands.
- `auth`: shared-secret membership proofs (HMAC-SHA256) carried in messages, for swarms that
  run without TLS or want a second check. Pure: no grpc, no asyncio.

Nothing is imported here, so `from neuronode.security import auth` stays free of grpc and
cryptography.
"""
