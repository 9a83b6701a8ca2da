"""Pipeline stages (installed as tosca_mlmt.pipelines)."""
