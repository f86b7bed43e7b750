"""Exporters: plugins that turn pool snapshots into a metrics backend's format."""
