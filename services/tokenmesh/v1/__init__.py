"""Generated from protos/tokenmesh/v1 by scripts/gen_protos.py. Do not edit."""
