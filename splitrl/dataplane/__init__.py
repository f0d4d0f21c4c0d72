"""The bulk weight data plane: a framed TCP (or TLS) stream beside gRPC that carries a weight
push at close to wire speed and relays it from sampler to sampler (docs/weight-sync.md).

- :mod:`splitrl.dataplane.frames`: framing, connections, deadlines;
- :mod:`splitrl.dataplane.server`: the listening side (one handler per connection);
- :mod:`splitrl.dataplane.link`: the sending end of one push (trainer -> head, relay -> next).

The contract of the bytes themselves (chunks, regions, checksums, deltas) is ``splitrl.wire``;
the frames are ``protos/splitrl/v1/dataplane.proto``.
"""
