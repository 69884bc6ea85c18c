"""One coalesced change to a record, and the Lua script that applies it atomically in Redis.

Many scheduler events for one request merge into a single `RecordUpdate` before they are written, so
the update carries the ordered path of statuses it went through, not only the last one: the server
checks each step against the stored status (a late "running" cannot overwrite "finished", whichever
writer sent it) and counts every running -> queued step as a preemption. Checking and writing in one
script makes it a single atomic step, so writes from different batches or processes cannot race.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvstore.records import (
    ALLOWED_TRANSITIONS,
    FIRST_WRITE_WINS,
    TERMINAL_STATUSES,
    RecordStatus,
    record_key,
)

_RUNNING = RecordStatus.RUNNING.value
_QUEUED = RecordStatus.QUEUED.value


@dataclass(slots=True)
class RecordUpdate:
    request_id: str
    # Unique per update, set when it is taken for writing. The script stores it in the hash, so a
    # batch resent because the connection broke before Redis's reply came back does not apply (and
    # count preemptions) twice.
    write_id: str = ""
    fields: dict[str, str] = field(default_factory=dict)  # encoded values, last write wins
    first_fields: dict[str, str] = field(default_factory=dict)  # FIRST_WRITE_WINS, first value wins
    # [[status, extra_preemption_cycles], ...]: statuses in the order they happened. A cycle is a
    # running -> queued -> running loop folded into the running step before it, so the path stays at
    # most four steps long however often a request is preempted while Redis is away.
    path: list[list] = field(default_factory=list)
    must_exist: bool = False  # True: never create the record (orphan clean-up)

    @property
    def last_status(self) -> str | None:
        return self.path[-1][0] if self.path else None

    @property
    def is_terminal(self) -> bool:
        return self.last_status in TERMINAL_STATUSES

    def add_status(self, status: str) -> None:
        path = self.path
        if path and path[-1][0] == status:
            return
        if status == _RUNNING and len(path) >= 2 and path[-1][0] == _QUEUED and path[-2][0] == _RUNNING:
            path.pop()
            path[-1][1] += 1
            return
        path.append([status, 0])

    def set_field(self, name: str, encoded_value: str) -> None:
        if name in FIRST_WRITE_WINS:
            self.first_fields.setdefault(name, encoded_value)
        else:
            self.fields[name] = encoded_value

    def body(self) -> dict[str, object]:
        body: dict[str, object] = {
            "fields": {"request_id": self.request_id, **self.fields},
            "first_fields": self.first_fields,
            "path": self.path,
            "write_id": self.write_id,
        }
        if self.must_exist:
            body["must_exist"] = True
        return body


def _lua_set(names) -> str:
    return "{" + ", ".join(f"{name} = true" for name in sorted(str(n) for n in names)) + "}"


_ALLOWED_LUA = "{" + ", ".join(
    f"{status} = {_lua_set(targets)}" for status, targets in ALLOWED_TRANSITIONS.items()
) + "}"

# One call writes a whole batch: a single command to pack and a single reply to parse keeps the
# client's CPU (which is the scheduler loop's CPU) small; per record it is still one atomic step.
# KEYS[i]: the record hash of update i. ARGV[1]: JSON list of RecordUpdate.body(). ARGV[2]: TTL (s).
# Returns two characters per update: applied (0 | 1) and status steps refused (capped at 9), or "E0"
# where Redis raised an error on that record (say the key holds another type); the first such error
# message follows a "|". pcall keeps one bad key from failing the rest of the batch.
UPDATE_RECORDS_LUA = f"""
local ALLOWED = {_ALLOWED_LUA}
local TERMINAL = {_lua_set(TERMINAL_STATUSES)}

local function apply(key, update, ttl_s)
  local current = redis.call('HGET', key, 'status')
  if current == false then
    -- a record with no status would be unreadable; orphan clean-up never invents records
    if update.must_exist or #update.path == 0 then return 0, 0 end
  elseif TERMINAL[current] then
    return 0, #update.path
  elseif redis.call('HGET', key, '_write_id') == update.write_id then
    return 1, 0  -- a resent batch that had already been applied
  end
  local refused, preemptions = 0, 0
  for _, step in ipairs(update.path) do
    local status, cycles = step[1], step[2]
    -- a missing record starts wherever its first write says (its queued write may have been dropped)
    if current == false or status == current or (ALLOWED[current] or {{}})[status] then
      if current == 'running' and status == 'queued' then preemptions = preemptions + 1 end
      current = status
      if status == 'running' then preemptions = preemptions + cycles end
    else
      refused = refused + 1
    end
  end
  local values = {{'_write_id', update.write_id, 'status', current}}
  for name, value in pairs(update.fields) do
    values[#values + 1] = name
    values[#values + 1] = value
  end
  redis.call('HSET', key, unpack(values))
  for name, value in pairs(update.first_fields) do redis.call('HSETNX', key, name, value) end
  if preemptions > 0 then redis.call('HINCRBY', key, 'num_preemptions', preemptions) end
  redis.call('EXPIRE', key, ttl_s)
  return 1, refused
end

local updates = cjson.decode(ARGV[1])
local codes, first_error = {{}}, nil
for index, update in ipairs(updates) do
  local ok, applied, refused = pcall(apply, KEYS[index], update, ARGV[2])
  if ok then
    codes[index] = applied .. math.min(refused, 9)
  else
    codes[index] = 'E0'
    first_error = first_error or tostring(applied and applied.err or applied)
  end
end
if first_error then return table.concat(codes) .. '|' .. first_error end
return table.concat(codes)
"""


def script_args(updates: list[RecordUpdate], ttl_s: int) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV for UPDATE_RECORDS_LUA."""
    keys = [record_key(update.request_id) for update in updates]
    return keys, [json.dumps([update.body() for update in updates], separators=(",", ":")), ttl_s]


def parse_results(reply: str | bytes) -> tuple[list[tuple[int, int] | None], str | None]:
    """UPDATE_RECORDS_LUA's reply: (applied, refused status steps) per update, None for a record
    Redis raised an error on, and the first such error message."""
    text = reply.decode() if isinstance(reply, bytes) else reply
    codes, _, first_error = text.partition("|")
    results = [
        None if codes[i] == "E" else (int(codes[i]), int(codes[i + 1])) for i in range(0, len(codes), 2)
    ]
    return results, first_error or None
