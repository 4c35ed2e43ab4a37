"""The wire: message format, catalogue, transport, CURVE security, compression."""
