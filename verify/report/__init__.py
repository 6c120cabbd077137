"""Reports: the rows as they finish (JSON lines), then JSON, Markdown, JUnit and HTML; progress."""
