"""megajax.observe.schedule on scheduled modules written by hand (what XLA:GPU prints after
its scheduler): a collective overlaps compute only when a kernel runs between its start and
its done; blocking collectives, async-wrapped ones and a loop's copies are found."""

from megajax.observe.schedule import async_collectives, loop_copies, overlap_counts, synchronous_collectives

MODULE = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%wrapped_all_to_all (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %a2a = f32[8] all-to-all(%p), replica_groups={{0,1}}, dimensions={0}
}

%body (carry: (s32[], f32[4,256])) -> (s32[], f32[4,256]) {
  %carry = (s32[], f32[4,256]) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %buffer = f32[4,256] get-tuple-element(%carry), index=1
  %copy.1 = f32[4,256] copy(%buffer)
  %permute-start = (f32[4,256], f32[4,256]) collective-permute-start(%copy.1), source_target_pairs={{0,1},{1,0}}
  %permute-done = f32[4,256] collective-permute-done(%permute-start)
  ROOT %next = (s32[], f32[4,256]) tuple(%i, %permute-done)
}

%cond (carry.1: (s32[], f32[4,256])) -> pred[] {
  %carry.1 = (s32[], f32[4,256]) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (x: f32[8], y: f32[4,256]) -> f32[8] {
  %x = f32[8] parameter(0)
  %y = f32[4,256] parameter(1)
  %gather-start = (f32[8], f32[16]) all-gather-start(%x), replica_groups={{0,1}}, dimensions={0}
  %fusion.1 = f32[8] fusion(%x), kind=kLoop, calls=%add
  %gather-done = f32[16] all-gather-done(%gather-start)
  %reduce-start = f32[8] all-reduce-start(%fusion.1), replica_groups={{0,1}}, to_apply=%add
  %reduce-done = f32[8] all-reduce-done(%reduce-start)
  %blocking = f32[8] all-reduce(%reduce-done), replica_groups={{0,1}}, to_apply=%add
  %async-start = ((f32[8]), f32[8]) async-start(%blocking), calls=%wrapped_all_to_all
  %gemm = f32[8] custom-call(%blocking), custom_call_target="__cublas$gemm"
  %async-done = f32[8] async-done(%async-start)
  %init = (s32[], f32[4,256]) tuple(%x, %y)
  %loop = (s32[], f32[4,256]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8] add(%async-done, %fusion.1)
}
"""


def test_a_kernel_between_start_and_done_is_what_overlap_means():
  found = {c.start.name: c for c in async_collectives(MODULE)}
  assert found["gather-start"].overlapped and found["gather-start"].compute_between == 1
  assert not found["reduce-start"].overlapped                     # its done follows at once
  assert found["async-start"].kind == "all-to-all" and found["async-start"].overlapped   # the GEMM under it
  assert not found["permute-start"].overlapped and found["permute-start"].computation == "body"


def test_blocking_collectives_count_in_the_total_and_wrapped_ones_once():
  assert [i.name for i in synchronous_collectives(MODULE)] == ["blocking"]
  counts = overlap_counts(MODULE)
  assert counts[("all-gather", "other")] == (1, 1)
  assert counts[("all-reduce", "other")] == (0, 2)                # the async one and the blocking one
  assert counts[("all-to-all", "other")] == (1, 1)
  assert counts[("collective-permute", "other")] == (0, 1)


def test_copies_inside_a_loop_body_are_found_with_their_bytes():
  assert loop_copies(MODULE) == [("body", 4 * 256 * 4, "f32[4,256]")]
