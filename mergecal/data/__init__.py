"""Task suites built offline from what ships in packages (see ../shared/notes/offline-materials.md)."""
