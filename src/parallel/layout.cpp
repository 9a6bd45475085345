#include "parallel/layout.h"

#include "common/error.h"

namespace kestrel {

void check_layout(const Layout& l, long experts) {
  if (l.tp < 1) fail("--tp: must be at least 1, got ", l.tp);
  if (l.ep != 1 && l.ep != l.tp)
    fail("--ep: must be 1 (experts split by tensor parallelism) or equal to --tp (", l.tp, "), got ", l.ep);
  if (l.ep > 1 && experts > 0 && experts % l.ep != 0)
    fail("--ep ", l.ep, ": ", experts, " experts do not divide evenly");
}

}  // namespace kestrel
