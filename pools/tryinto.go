// SPDX-License-Identifier: Apache-2.0

package pools

// TryAcquireInto is TryAcquire for callers that refuse often and want the
// refused path free of allocation: on refusal it fills rf (owned by the
// caller, never retained by the pool) and returns ok false; on admission rf
// is left alone, except in dry-run: an ask the rule refuses is admitted, and
// rf holds the refusal it would have been, with WouldRefuse set. rf must not
// be nil.
//
// Why a second method rather than a cheaper TryAcquire: TryAcquire's error is
// a *Refusal, and a *Refusal that callers may keep (wrap with %w, hand to
// another goroutine, read after the next refusal) must be a fresh
// allocation. Reusing one per project would let a later refusal rewrite a
// value an earlier caller still reads, a data race the type system cannot
// flag; a non-pointer error value stored in an interface allocates as well.
// Storage the caller provides is the only sound way to 0 allocs.
func (p *Pool) TryAcquireInto(project string, rf *Refusal) (pm Permit, ok bool) {
	return p.tryAcquireInto(project, rf, true)
}

// TryAcquireFirst is TryAcquireInto for a caller that waits in Acquire when
// refused: a refusal is neither counted nor written into rf, since the ask
// is not over (Acquire counts it if it ends refused). An ask is one
// refusal, however it waits.
func (p *Pool) TryAcquireFirst(project string, rf *Refusal) (pm Permit, ok bool) {
	return p.tryAcquireInto(project, rf, false)
}

func (p *Pool) tryAcquireInto(project string, rf *Refusal, count bool) (pm Permit, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	idx := p.l.lookup(project)
	p.l.seen(idx)
	if p.l.admits(idx) {
		return p.grantLocked(idx), true
	}
	if p.l.dry(idx) {
		p.l.fillWould(idx, rf)
		return p.grantLocked(idx), true
	}
	if count {
		p.l.fillRefusal(idx, rf)
	}
	return Permit{}, false
}
