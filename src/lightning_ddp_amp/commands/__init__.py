"""The ``lightning-ddp-amp`` commands: ``env``, ``compare``, and the conversion of a classic checkpoint."""
