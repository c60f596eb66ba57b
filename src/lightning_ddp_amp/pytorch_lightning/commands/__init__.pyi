# Generated from ../../commands/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""The ``lightning-ddp-amp`` commands: ``env``, ``compare``, and the conversion of a classic checkpoint."""
