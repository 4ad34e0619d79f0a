"""A one-file repository task whose hidden tests are unittest's (the base interpreter runs them in the
host jail without pytest): the test patch, and the ids `unittest -v` prints (swebench's django parser)."""

import sys

TEST_PATCH = """\
diff --git a/test_app.py b/test_app.py
new file mode 100644
--- /dev/null
+++ b/test_app.py
@@ -0,0 +1,9 @@
+import unittest
+import app
+
+
+class T(unittest.TestCase):
+    def test_answer(self):
+        self.assertEqual(app.answer(), 42)
+    def test_name(self):
+        self.assertEqual(app.NAME, "app")
"""
BUGGY = 'NAME = "app"\n\n\ndef answer():\n    return 41\n'


def unittest_id(name: str) -> str:
    return f"{name} (test_app.T.{name})" if sys.version_info >= (3, 11) else f"{name} (test_app.T)"
