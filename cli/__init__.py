"""The mlmt command line (installed as tosca_mlmt.cli)."""
