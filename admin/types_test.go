// SPDX-License-Identifier: Apache-2.0

package admin

import "testing"

func TestPoolConsistent(t *testing.T) {
	ok := Pool{Name: "p", Enforcer: "daemon", Size: 10, Floor: 1, InUse: 3, Active: 2, Share: 5, Admitted: 9, Refused: 1,
		Projects:  []Project{{Project: "a", Held: 2, Admitted: 4}, {Project: "b", Held: 1, Admitted: 3, Refused: 1}},
		Forgotten: Forgotten{Projects: 1, Admitted: 2}}
	if err := ok.Consistent(); err != nil {
		t.Fatal(err)
	}
	for name, edit := range map[string]func(*Pool){
		"in use":    func(p *Pool) { p.InUse++ },
		"admitted":  func(p *Pool) { p.Forgotten.Admitted = 0 },
		"refused":   func(p *Pool) { p.Refused = 0 },
		"share":     func(p *Pool) { p.Active = 3 },
		"off share": nil,
	} {
		p := ok
		p.Projects = append([]Project(nil), ok.Projects...)
		if edit == nil {
			p.Enforcer, p.Active = "off", 7 // not enforced: no share to check
			if err := p.Consistent(); err != nil {
				t.Errorf("%s: %v", name, err)
			}
			continue
		}
		edit(&p)
		if err := p.Consistent(); err == nil {
			t.Errorf("%s: a pool that does not add up passes", name)
		}
	}
}
