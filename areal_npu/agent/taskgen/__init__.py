"""Generated SWE tasks from real libraries (SWE-smith's method): a pinned description
(:mod:`.spec`), planted bugs (:mod:`.mutations`), the library's own suite as the filter
(:mod:`.suite`), issue-like statements (:mod:`.statement`), and the build (:mod:`.build`)."""
